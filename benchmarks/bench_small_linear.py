"""The CPU kernel for x W^T over a few rows (``qkmla.ops.small_linear``) against ``F.linear``,
side by side, over weight shapes, rows of x and threads.

    python benchmarks/bench_small_linear.py [--shapes 512x512 2048x512 16384x512]
        [--rows 1 2 4 8 16 32 64 256] [--threads 1 2] [--reps 7] [--out FILE.json] [--overwrite]

A shape NxK is W [N, K] in bfloat16: N = h d_n, K = d_c, the key scalars' GEMM of a QK-normed
layer (``attention.absorbed.key_scalars``): 16 heads of 32 (the vLLM decode benchmark's model),
16 of 128 (DeepSeek-V3 at tensor parallel 8), 128 of 128 (DeepSeek-V3 on one rank). Each timing
is ``--calls`` calls in a loop, wall clock; the two are timed in turn, the order alternating, and
a cell's ratio is the median of the per-pair ratios kernel / F.linear. ``F.linear`` is what the
layer calls where the kernel does not run (oneDNN's bf16 GEMM on this kind of CPU). This is
where ``MAX_ROWS_WITH_AMX`` comes from on CPUs without AMX (``qkmla/ops/small_linear.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_paged_layouts import paired  # noqa: E402 (pairs timed alike)
from recipe_common import positive  # noqa: E402


def shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NxK (for example 2048x512), got {text!r}") from None
    if n < 1 or k < 2 or k % 2:
        raise argparse.ArgumentTypeError(f"expected N >= 1 and K even >= 2, got {text!r}")
    return n, k


def calls(n: int, k: int, rows: int, repeat: int, seed: int = 0):
    """(F.linear, kernel): each ``repeat`` calls of x [rows, k] @ W [n, k]^T."""
    from qkmla.ops.small_linear import pack_weight, small_linear

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    packed = pack_weight(w)

    def gemm():
        for _ in range(repeat):
            torch.nn.functional.linear(x, w)

    def kernel():
        for _ in range(repeat):
            small_linear(x, packed)
    return gemm, kernel


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", type=shape, default=[(512, 512), (2048, 512), (16384, 512)],
                   metavar="NxK")
    p.add_argument("--rows", nargs="+", type=positive, default=[1, 2, 4, 8, 16, 32, 64, 256])
    p.add_argument("--threads", nargs="+", type=positive, default=[1, 2])
    p.add_argument("--reps", type=positive, default=7, help="pairs of timings per cell (default 7)")
    p.add_argument("--calls", type=positive, default=200, help="calls per timing (default 200)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE.parent / "src"))
    from recipe_common import check_out

    from qkmla.files import write_text
    from qkmla.machine import machine, recorded_command, source_commit
    from qkmla.ops.small_linear import MAX_ROWS_WITH_AMX, kernel_unavailable

    check_out(p, args.out, args.overwrite)  # before any work
    reason = kernel_unavailable()
    if reason is not None:
        p.error(f"the CPU kernel cannot run here: {reason}")
    threads = torch.get_num_threads()
    out_rows = []
    try:
        for n_threads in args.threads:
            torch.set_num_threads(n_threads)
            for n, k in args.shapes:
                for rows in args.rows:
                    repeat = max(1, args.calls * 8 // max(rows, 8) // max(1, n // 2048))
                    t = paired(*calls(n, k, rows, repeat), args.reps, names=("linear", "kernel"),
                               clock=time.perf_counter)
                    row = {"threads": n_threads, "N": n, "K": k, "rows": rows, "calls": repeat,
                           "linear_us": round(t["linear_ms"] * 1e3 / repeat, 2),
                           "kernel_us": round(t["kernel_ms"] * 1e3 / repeat, 2),
                           "kernel_over_linear": t["kernel_over_linear"],
                           "kernel_over_linear_quartiles": t["kernel_over_linear_quartiles"]}
                    out_rows.append(row)
                    print(f"{n_threads} threads, W {n}x{k}, {rows:4d} rows: F.linear {row['linear_us']:9.2f} us  "
                          f"kernel {row['kernel_us']:9.2f} us  kernel / F.linear {row['kernel_over_linear']:.3f}",
                          flush=True)
    finally:  # a caller in the same process (the tests) keeps its threads
        torch.set_num_threads(threads)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    result = {"command": recorded_command("benchmarks/bench_small_linear.py", argv), "commit": source_commit(HERE),
              "machine": {**machine(), "amx": amx}, "reps": args.reps,
              "load_average_1min": round(os.getloadavg()[0], 2), "max_rows_with_amx": MAX_ROWS_WITH_AMX,
              "rows": out_rows}
    if args.out is not None:
        write_text(args.out, json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
