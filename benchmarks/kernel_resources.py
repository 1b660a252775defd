"""What the Triton decode kernel needs of a GPU, per launch configuration, compiled here with
no GPU: shared memory, registers and stack (spills) per thread.

    python -m benchmarks.kernel_resources [--arch 90] [--heads 16 128] [--formats dense fp8 int8 int4]
                                          [--all-configs] [--out FILE.json] [--overwrite]

Triton compiles ``_mla_decode_split_kernel`` for ``sm_<arch>`` through its own ptxas (its
NVIDIA backend needs no GPU nor CUDA install) at DeepSeek-V3's widths (d_c 512, d_r 64, one
key scalar per head, bf16 queries, page 64), with the arguments the launcher builds
(``split_kernel_args``) for such tensors and Triton's specialization of them (an int or an
address divisible by 16 is marked so: the 644-byte int8 row's stride is not);
``cuobjdump --dump-resource-usage`` (also shipped with Triton) reads registers and stack
from the cubin. For each (heads, format) it
walks ``LAUNCH_CONFIGS`` as the launcher does, taking the first whose shared memory fits
``--shared-limit`` (an H100's 232,448 B a program by default), or every configuration with
``--all-configs``. Figures depend on the Triton version, which the output names. A stack of
several KiB a thread means the kernel spills its tiles to local memory: on an H100, fp8 rows
whose per-value scale gather spilled 5,480 B a thread at 32 registers ran 44x slower than
bf16 rows (``benchmarks/results/gpu/nvidia-h100-80gb-hbm3/recheck``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from qkmla.kv_formats import KV_FORMATS, row_format

from .common import start_record

H100_SHARED_LIMIT = 232_448  # bytes a program may opt in to on an H100 (Triton's "Hardware limit")
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
                torch.int32: "i32", torch.int64: "i64"}


def decode_inputs(heads: int, kv_format: str, q_dtype: torch.dtype, d_c: int = 512, d_r: int = 64, page: int = 64,
                  blocks: int = 4) -> dict:
    """Small CPU tensors of the real widths and layouts (one sequence, one query token, one key
    scalar per head): what the launcher's arguments are built from."""
    rows = row_format(kv_format, d_c, d_r)
    kv_dtype = torch.bfloat16 if kv_format == "dense" else torch.uint8
    return dict(q_lat=torch.zeros(1, 1, heads, d_c, dtype=q_dtype), q_rope=torch.zeros(1, 1, heads, d_r, dtype=q_dtype),
                kv_cache=torch.zeros(blocks, page, rows.width, dtype=kv_dtype),
                scale_cache=torch.zeros(blocks, page, heads, dtype=torch.bfloat16),
                block_table=torch.arange(blocks, dtype=torch.int32)[None],
                cache_seqlens=torch.tensor([blocks * page], dtype=torch.int32))


def compile_split_kernel(arch: int, heads: int, kv_format: str, index: int, q_dtype: str = "bf16",
                         num_splits: int = 4) -> dict:
    """Compile the split kernel for sm_<arch> with ``LAUNCH_CONFIGS[index]``, specialized as a
    launch over ``decode_inputs`` would be (Triton marks an int argument, or a tensor's address,
    divisible by 16); its shared memory, registers and stack."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qkmla.ops.mla_decode import triton_kernel as tk

    t = decode_inputs(heads, kv_format, torch.float32 if q_dtype == "fp32" else torch.bfloat16)
    B, S_q, H, d_c = t["q_lat"].shape
    launch = tk.launch_config(H, B * S_q, t["block_table"].shape[1] * t["kv_cache"].shape[1], None, index, num_splits)
    o_part = torch.zeros(B, S_q, H, num_splits, d_c)
    lse_part = torch.zeros(B, S_q, H, num_splits)
    args, options = tk.split_kernel_args(t["q_lat"], t["q_rope"], t["kv_cache"], t["scale_cache"], t["block_table"],
                                         t["cache_seqlens"], 0.1, o_part, lse_part, launch, kv_format=kv_format)
    kernel = tk._mla_decode_split_kernel
    num_warps, num_stages = options.pop("num_warps"), options.pop("num_stages")
    names = kernel.arg_names
    sig, attrs = {}, {}
    for i, (name, value) in enumerate(zip(names, args)):
        if isinstance(value, torch.Tensor):
            sig[name], aligned = "*" + TRITON_TYPES[value.dtype], value.data_ptr() % 16 == 0
        elif isinstance(value, float):
            sig[name], aligned = "fp32", False
        else:
            sig[name], aligned = ("i32" if abs(value) < 2 ** 31 else "i64"), value % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    sig.update({name: "constexpr" for name in options})
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in options.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    return {"heads": heads, "kv_format": kv_format, "q_dtype": q_dtype, "config": index,
            "launch": {k: launch[k] for k in ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages")},
            "row_bytes": t["kv_cache"].stride(1) * t["kv_cache"].element_size(),
            "shared_bytes": compiled.metadata.shared,
            "registers": int(found["REG"]), "stack_bytes": int(found["STACK"])}


def first_fitting(arch: int, heads: int, kv_format: str, limit: int, q_dtype: str = "bf16") -> dict:
    """The launcher's choice on a GPU allowing ``limit`` bytes of shared memory a program."""
    from qkmla.ops.mla_decode.triton_kernel import LAUNCH_CONFIGS

    for index in range(len(LAUNCH_CONFIGS)):
        row = compile_split_kernel(arch, heads, kv_format, index, q_dtype)
        if row["shared_bytes"] <= limit:
            return row
    return {**row, "fits": False}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability as one number (90: H100/H200)")
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--formats", nargs="+", default=list(KV_FORMATS), choices=KV_FORMATS)
    p.add_argument("--q-dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--shared-limit", type=int, default=H100_SHARED_LIMIT)
    p.add_argument("--all-configs", action="store_true", help="every configuration, not only the first that fits")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    bad = [h for h in args.heads if h < 1]
    if bad:
        p.error(f"--heads: expected positive ints, got {bad}")
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("TRITON_INTERPRET=1: the interpreter compiles nothing; unset it")
    result, write = start_record(p, args, __spec__.name, argv)
    try:
        import triton
        from triton.backends import backends
    except ImportError:
        p.error("this needs the triton package")
    if "nvidia" not in backends:
        p.error(f"Triton {triton.__version__} has no NVIDIA backend here")

    from qkmla.ops.mla_decode.triton_kernel import LAUNCH_CONFIGS

    rows = []
    for heads in args.heads:
        for kv_format in args.formats:
            if args.all_configs:
                found = [compile_split_kernel(args.arch, heads, kv_format, i, args.q_dtype)
                         for i in range(len(LAUNCH_CONFIGS))]
            else:
                found = [first_fitting(args.arch, heads, kv_format, args.shared_limit, args.q_dtype)]
            for row in found:
                row.setdefault("fits", row["shared_bytes"] <= args.shared_limit)
                print(json.dumps(row), flush=True)
            rows += found
    result.update(triton=triton.__version__, arch=f"sm_{args.arch}", shared_limit=args.shared_limit,
                  launch_configs=LAUNCH_CONFIGS, rows=rows)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
