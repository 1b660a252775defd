"""What the Triton decode kernel needs of a GPU, per launch configuration, compiled here with
no GPU: shared memory, registers and stack (spills) per thread.

    python benchmarks/kernel_resources.py [--arch 90] [--heads 16 128] [--formats dense fp8 int8 int4]
                                          [--all-configs] [--out FILE.json] [--overwrite]

Triton compiles ``_mla_decode_split_kernel`` for ``sm_<arch>`` through its own ptxas (its
NVIDIA backend needs no GPU nor CUDA install) at DeepSeek-V3's widths (d_c 512, d_r 64, one
key scalar per head, bf16 queries, page 64); ``cuobjdump --dump-resource-usage`` (also
shipped with Triton) reads registers and stack from the cubin. For each (heads, format) it
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from recipe_common import check_out  # noqa: E402

H100_SHARED_LIMIT = 232_448  # bytes a program may opt in to on an H100 (Triton's "Hardware limit")
FORMATS = ("dense", "fp8", "int8", "int4")


def kernel_signature(kernel, constexprs: dict, q_dtype: str, bytes_rows: bool) -> dict:
    """Triton's signature of the split kernel: pointer and scalar types, constexprs marked."""
    pointers = {"q_lat_ptr": q_dtype, "q_rope_ptr": q_dtype, "kv_ptr": "u8" if bytes_rows else q_dtype,
                "scale_ptr": "bf16", "block_table_ptr": "i32", "seqlens_ptr": "i32", "visible_ptr": "i32",
                "o_part_ptr": "fp32", "lse_part_ptr": "fp32"}
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        else:
            sig[name] = "fp32" if name == "softmax_scale" else "i32"  # the strides
    return sig


def compile_split_kernel(arch: int, heads: int, kv_format: str, index: int, q_dtype: str = "bf16") -> dict:
    """Compile the split kernel for sm_<arch> with ``LAUNCH_CONFIGS[index]``; its resources."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from qkmla.kv_formats import row_format
    from qkmla.ops.mla_decode import triton_kernel as tk

    d_c, d_r, page = 512, 64, 64
    launch = tk.launch_config(heads, 1, page, None, index, num_splits=4)
    group, scale_off, rope_off = 1, 0, 0
    if kv_format != "dense":
        rows = row_format(kv_format, d_c, d_r)
        group, scale_off, rope_off = min(rows.group_size, d_c), rows.layout.scale_offset, rows.layout.rope_offset
    constexprs = dict(S_Q=1, H=heads, HEADS_PER_GROUP=1, D_C=d_c, D_R=d_r, PAGE=page, BLOCK_H=launch["BLOCK_H"],
                      BLOCK_N=launch["BLOCK_N"], NUM_SPLITS=4, USE_SCALE=True, UNIFIED=False, HAS_VISIBLE=False,
                      DOT_FP32=False, DOT_IEEE=q_dtype == "fp32", KV_FORMAT=tk.FORMAT_IDS[kv_format], GROUP=group,
                      SCALE_OFF=scale_off, ROPE_OFF=rope_off)
    kernel = tk._mla_decode_split_kernel
    sig = kernel_signature(kernel, constexprs, q_dtype, kv_format != "dense")
    # pointers and strides divisible by 16, as the launcher's real tensors are
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n] not in ("constexpr",
                                                                                                       "fp32")}
    src = ASTSource(fn=kernel, signature=sig, attrs=attrs,
                    constexprs={(kernel.arg_names.index(n),): v for n, v in constexprs.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    return {"heads": heads, "kv_format": kv_format, "q_dtype": q_dtype, "config": index,
            "launch": {k: launch[k] for k in ("BLOCK_H", "BLOCK_N", "num_warps", "num_stages")},
            "shared_bytes": compiled.metadata.shared, "registers": int(found["REG"]),
            "stack_bytes": int(found["STACK"])}


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
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
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
    check_out(p, args.out, args.overwrite)
    try:
        import triton
        from triton.backends import backends
    except ImportError:
        p.error("this needs the triton package")
    if "nvidia" not in backends:
        p.error(f"Triton {triton.__version__} has no NVIDIA backend here")

    from qkmla.files import write_text
    from qkmla.machine import recorded_command, source_commit
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
    result = {"command": recorded_command("benchmarks/kernel_resources.py", argv),
              "commit": source_commit(HERE), "triton": triton.__version__, "arch": f"sm_{args.arch}",
              "shared_limit": args.shared_limit, "launch_configs": LAUNCH_CONFIGS, "rows": rows}
    if args.out is not None:
        write_text(args.out, json.dumps(result, indent=1) + "\n")
        print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
