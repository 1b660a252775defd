"""The CPU kernel for x W^T over a few rows (``qkmla.ops.small_linear``) against ``F.linear``,
side by side, over weight shapes, rows of x and threads; with ``--statistic``, the kernel for
the key scalars (``group_statistic``) against ``F.linear`` and the norm's statistic in torch.

    python -m benchmarks.bench_small_linear [--shapes 512x512 2048x512 16384x512]
        [--rows 1 2 4 8 16 32 64 256] [--threads 1 2] [--reps 7] [--out FILE.json] [--overwrite]
    python -m benchmarks.bench_small_linear --statistic [--shapes 16x32x512 16x128x512 128x128x512] ...

A shape NxK is W [N, K] in bfloat16: N = h d_n, K = d_c, the key scalars' GEMM of a QK-normed
layer (``attention.absorbed.key_scalars``): 16 heads of 32 (the vLLM decode benchmark's model),
16 of 128 (DeepSeek-V3 at tensor parallel 8), 128 of 128 (DeepSeek-V3 on one rank). Each timing
is ``--calls`` calls in a loop, wall clock; the two are timed in turn, the order alternating, and
a cell's ratio is the median of the per-pair ratios kernel / F.linear. ``F.linear`` is what the
layer calls where the kernel does not run (oneDNN's bf16 GEMM on this kind of CPU). This is
where ``MAX_ROWS_WITH_AMX`` comes from on CPUs without AMX (``qkmla/ops/small_linear.py``).

With ``--statistic`` a shape GxgxK is W_UK as G groups (heads) of g rows of K: the RMS key
scalar of each group for each row of x, through ``group_statistic``'s kernel over W as vLLM holds it (a
strided view: each group's rows followed by as many others, its W_UV rows in ``kv_b_proj``'s
weight), against ``qkmla.ops.statistic.statistic`` of ``F.linear`` over a contiguous copy (what the
layers compute where the kernel does not run; a GEMM over the view would copy it every call).
This is where ``GROUP_KERNEL_MAX_ROWS`` comes from.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from .bench_paged_layouts import paired  # pairs timed alike
from .common import positive, start_record, torch_threads


PRODUCT_SHAPES = [(512, 512), (2048, 512), (16384, 512)]  # N = h d_n: 16 heads of 32, 16 and 128 of 128
STATISTIC_SHAPES = [(16, 32, 512), (16, 128, 512), (128, 128, 512)]  # the same as groups of rows


def shape(text: str) -> tuple[int, ...]:
    """NxK (a weight), or GxgxK (G groups of g rows, for --statistic)."""
    try:
        dims = tuple(int(v) for v in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) not in (2, 3):
        raise argparse.ArgumentTypeError(f"expected NxK or GxgxK (for example 2048x512, 16x128x512), got {text!r}")
    if min(dims[:-1]) < 1 or dims[-1] < 2 or dims[-1] % 2:
        raise argparse.ArgumentTypeError(f"expected sizes >= 1 and K even >= 2, got {text!r}")
    return dims


def statistic_calls(G: int, group: int, k: int, rows: int, repeat: int, seed: int = 0):
    """(F.linear + statistic, kernel): each ``repeat`` calls of the RMS statistic of each of G
    groups of x [rows, k] @ W^T, W [G, group, k] (the kernel over a strided view, F.linear over a
    contiguous copy)."""
    from qkmla.ops.statistic import statistic

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(G, 2 * group, k, generator=gen).to(torch.bfloat16)[:, :group]
    flat = w.reshape(G * group, k)  # a copy
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)

    def gemm():
        for _ in range(repeat):
            statistic(torch.nn.functional.linear(x, flat).unflatten(-1, (G, group)), "rms")

    def kernel():  # the op itself, at every row count (group_statistic hands many rows to F.linear)
        for _ in range(repeat):
            torch.ops.qkmla_cpu.group_statistic(x, w, "rms", 2.0, 1e-6)
    return gemm, kernel


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
    p.add_argument("--shapes", nargs="+", type=shape, default=None, metavar="NxK",
                   help="weights NxK (default 512x512 2048x512 16384x512), GxgxK with --statistic "
                        "(default 16x32x512 16x128x512 128x128x512)")
    p.add_argument("--statistic", action="store_true",
                   help="time the key scalars' statistic (group_statistic) instead of the product")
    p.add_argument("--rows", nargs="+", type=positive, default=[1, 2, 4, 8, 16, 32, 64, 256])
    p.add_argument("--threads", nargs="+", type=positive, default=[1, 2])
    p.add_argument("--reps", type=positive, default=7, help="pairs of timings per cell (default 7)")
    p.add_argument("--calls", type=positive, default=200, help="calls per timing (default 200)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    from qkmla.ops.small_linear import MAX_ROWS_WITH_AMX, kernel_unavailable

    if args.shapes is None:
        args.shapes = STATISTIC_SHAPES if args.statistic else PRODUCT_SHAPES
    wanted = 3 if args.statistic else 2
    if any(len(s) != wanted for s in args.shapes):
        p.error(f"--shapes: expected {'GxgxK with --statistic' if args.statistic else 'NxK'}, got "
                f"{' '.join('x'.join(map(str, s)) for s in args.shapes)}")
    out_rows = []
    result, write = start_record(
        p, args, __spec__.name, argv, reps=args.reps,
        what="statistic: group_statistic over F.linear + ops.statistic.statistic" if args.statistic else
        "product: small_linear over F.linear", max_rows_with_amx=MAX_ROWS_WITH_AMX, rows=out_rows)
    result["machine"]["amx"] = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    reason = kernel_unavailable()
    if reason is not None:
        p.error(f"the CPU kernel cannot run here: {reason}")
    with torch_threads(0):  # each cell sets its own; the caller keeps its count
        for n_threads in args.threads:
            torch.set_num_threads(n_threads)
            for dims in args.shapes:
                n, k = dims[0] * dims[1] if args.statistic else dims[0], dims[-1]
                for rows in args.rows:
                    repeat = max(1, args.calls * 8 // max(rows, 8) // max(1, n // 2048))
                    make = (lambda: statistic_calls(*dims, rows, repeat)) if args.statistic else (
                        lambda: calls(n, k, rows, repeat))
                    t = paired(*make(), args.reps, names=("linear", "kernel"), clock=time.perf_counter)
                    groups = {"G": dims[0], "group": dims[1]} if args.statistic else {}
                    row = {"threads": n_threads, "N": n, "K": k, **groups, "rows": rows, "calls": repeat,
                           "linear_us": round(t["linear_ms"] * 1e3 / repeat, 2),
                           "kernel_us": round(t["kernel_ms"] * 1e3 / repeat, 2),
                           "kernel_over_linear": t["kernel_over_linear"],
                           "kernel_over_linear_quartiles": t["kernel_over_linear_quartiles"]}
                    out_rows.append(row)
                    print(f"{n_threads} threads, W {n}x{k}, {rows:4d} rows: F.linear {row['linear_us']:9.2f} us  "
                          f"kernel {row['kernel_us']:9.2f} us  kernel / F.linear {row['kernel_over_linear']:.3f}",
                          flush=True)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
