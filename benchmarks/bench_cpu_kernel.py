"""Where the CPU decode kernel beats the torch backend: ``mla_decode_with_kvcache`` through
``backend="cpu"`` and ``backend="torch"`` side by side, over head counts and query tokens.

    python -m benchmarks.bench_cpu_kernel [--heads 16 32 64 128] [--queries 1 2 4 8]
        [--points 4096x1 4096x4 16384x1] [--threads 2] [--reps 5] [--out FILE.json] [--overwrite]

A QK-normed bfloat16 paged cache (blocks of 16 tokens, d_c 512, d_r 64, one key scalar per
head, in vLLM's row [c | k_rope | r], the op given column views), S_q query tokens per sequence
over the whole context. Wall-clock time on ``--threads`` threads (the kernel splits keys across
threads, the torch backend's GEMMs use them), the two backends called in turn, the order
alternating; a cell's ratio is the median of the per-pair ratios kernel / torch. This is what
``AUTO_MAX_QUERY_HEADS`` (``qkmla/ops/mla_decode/cpu_kernel.py``) is set from.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from .bench_paged_layouts import BLOCK, paired, point  # blocks, points and pairs timed alike
from .common import positive, start_record, torch_threads

D_C, D_R = 512, 64


def calls(heads: int, queries: int, context: int, batch: int, seed: int = 0) -> dict:
    """{backend: call} over one cache: the same decode through both backends."""
    from qkmla.ops.mla_decode import mla_decode_with_kvcache

    gen = torch.Generator().manual_seed(seed)
    n_blocks = batch * context // BLOCK + 4
    rows = torch.randn(n_blocks, BLOCK, D_C + D_R + heads, generator=gen).to(torch.bfloat16)
    rows[..., D_C + D_R:] = rows[..., D_C + D_R:].abs() + 0.5  # a statistic: positive
    table = torch.randperm(n_blocks, generator=gen)[:batch * context // BLOCK].view(batch, -1).to(torch.int32)
    lengths = torch.full((batch,), context, dtype=torch.int32)
    q_lat = torch.randn(batch, queries, heads, D_C, generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(batch, queries, heads, D_R, generator=gen).to(torch.bfloat16)
    kv, scalars = rows[..., :D_C + D_R], rows[..., D_C + D_R:]
    return {backend: (lambda backend=backend: mla_decode_with_kvcache(
        q_lat, q_rope, kv, table, lengths, scalars, softmax_scale=(D_C + D_R) ** -0.5, backend=backend))
        for backend in ("torch", "cpu")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", type=positive, default=[16, 32, 64, 128])
    p.add_argument("--queries", nargs="+", type=positive, default=[1, 2, 4, 8], help="query tokens per sequence")
    p.add_argument("--points", nargs="+", type=point, default=[point(v) for v in ("4096x1", "4096x4", "16384x1")],
                   metavar="CONTEXTxBATCH")
    p.add_argument("--threads", type=positive, default=2)
    p.add_argument("--reps", type=positive, default=5, help="pairs of calls per cell (default 5)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    from qkmla.ops.mla_decode.cpu_kernel import AUTO_MAX_QUERY_HEADS, cpu_unsupported_for

    rows = []
    with torch_threads(args.threads):
        _, write = start_record(p, args, __spec__.name, argv, reps=args.reps,
                                auto_max_query_heads=AUTO_MAX_QUERY_HEADS, rows=rows)
        reason = cpu_unsupported_for("cpu", D_C, D_R, torch.bfloat16)
        if reason is not None:
            p.error(f"the CPU kernel cannot run here: {reason}")
        for heads in args.heads:
            for context, batch in args.points:
                for queries in args.queries:
                    row = {"heads": heads, "queries": queries, "context": context, "batch": batch,
                           **paired(*calls(heads, queries, context, batch).values(), args.reps, names=("torch", "cpu"),
                                   clock=time.perf_counter)}
                    rows.append(row)
                    print(f"{heads:4d} heads, S_q {queries}, {context:6d} x {batch}: torch {row['torch_ms']:9.3f} ms  "
                          f"kernel {row['cpu_ms']:9.3f} ms  kernel / torch {row['cpu_over_torch']:.3f}", flush=True)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
