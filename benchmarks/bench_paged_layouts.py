"""Where a QK-normed paged decode spends its extra time on the CPU: the torch backend of
``mla_decode_with_kvcache`` over two layouts of one bfloat16 paged cache, plain MLA and the QK
norm reading the same memory.

    python -m benchmarks.bench_paged_layouts [--points 1024x1 4096x8 ...] [--reps 20]
        [--backends torch cpu] [--profile 4096x8] [--baseline REV] [--out FILE.json] [--overwrite]

Layouts of blocks of 16 tokens (16 heads, d_c 512, d_r 64, G = 16 key scalars per token):

* ``row``: vLLM's, one row [c | k_rope | r] per token (1,184 bytes), the op given its column
  views, as ``qkmla.integrations.vllm`` hands them over;
* ``block``: a block's 16 rows [c | k_rope] (1,152 bytes each, so every row starts on a
  64-byte boundary), then its 16 x G scalars in one run.

Plain MLA reads vLLM's plain layout (rows [c | k_rope] of 1,152 bytes, back to back) over the
same buffer, so both variants of a point read one allocation: on a shared VM where a buffer
lands moves a read's speed by more than the difference sought.
Times are the CPU time of one thread (``time.thread_time``, torch on one thread), the two
variants called in turn, the order alternating; a point's ratio is the median of the per-pair
ratios. ``--profile CONTEXTxBATCH`` adds the self CPU time of each aten op per call for both
variants on the row layout (``torch.profiler``, six interleaved blocks of calls).
``--backends``: the op's backends timed (``torch``, and ``cpu``, the fused C++ kernel, where it
runs; both by default). With both, each variant also gets the kernel against the torch backend on
the row layout, timed in turn the same way (``kernel_rows``).
``--baseline REV`` adds, at every point on the row layout, the torch backend as it is against
the same backend at git revision REV (its ``torch_impl.py`` loaded beside the current one),
both variants, timed in turn the same way: a change to the read measured side by side.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import sys
import time
import types
import unittest.mock
from pathlib import Path

import torch

from .common import ROOT, start_record, torch_threads

HEADS, D_C, D_R, G, BLOCK = 16, 512, 64, 16, 16
LAYOUTS = ("row", "block")
DEFAULT_POINTS = ["1024x1", "4096x1", "16384x1", "1024x8", "4096x8", "16384x8"]


def point(text: str) -> tuple[int, int]:
    """'CONTEXTxBATCH' -> (context, batch): a context that fills whole blocks, a positive batch."""
    try:
        context, batch = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CONTEXTxBATCH such as 4096x8, got {text!r}") from None
    if context < BLOCK or context % BLOCK or batch < 1:
        raise argparse.ArgumentTypeError(f"expected a context that is a positive multiple of {BLOCK} and a "
                                         f"positive batch, got {text!r}")
    return context, batch


def caches(layout: str, context: int, batch: int, gen: torch.Generator):
    """(plain rows, rows [num_blocks, BLOCK, D_C + D_R], scalars [num_blocks, BLOCK, G], block_table
    [batch, blocks]): views of one bfloat16 buffer, the QK-normed ones laid out as ``layout``, the
    plain ones as plain MLA's cache; the blocks scattered, a few unused."""
    n_blocks = batch * context // BLOCK + 8
    width = D_C + D_R
    buf = torch.randn(n_blocks * BLOCK * (width + G), generator=gen).to(torch.bfloat16)
    plain = buf[:n_blocks * BLOCK * width].view(n_blocks, BLOCK, width)
    if layout == "row":
        full = buf.view(n_blocks, BLOCK, width + G)
        rows, scalars = full[..., :width], full[..., width:]
    else:
        per_block = buf.view(n_blocks, BLOCK * (width + G))
        rows = per_block[:, :BLOCK * width].view(n_blocks, BLOCK, width)
        scalars = per_block[:, BLOCK * width:].view(n_blocks, BLOCK, G)
    scalars.copy_(scalars.abs() + 0.5)  # a statistic: positive
    table = torch.randperm(n_blocks, generator=gen)[:batch * context // BLOCK].view(batch, -1).to(torch.int32)
    return plain, rows, scalars, table


def point_inputs(layout: str, context: int, batch: int, seed: int = 0):
    """(plain, rows, scalars, table, q_lat, q_rope, lengths, scale): one point's caches
    (:func:`caches`) and the decode step's queries over them."""
    gen = torch.Generator().manual_seed(seed)
    plain, rows, scalars, table = caches(layout, context, batch, gen)
    q_lat = torch.randn(batch, 1, HEADS, D_C, generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(batch, 1, HEADS, D_R, generator=gen).to(torch.bfloat16)
    lengths = torch.full((batch,), context, dtype=torch.int32)
    return plain, rows, scalars, table, q_lat, q_rope, lengths, (D_C + D_R) ** -0.5


def calls(layout: str, context: int, batch: int, seed: int = 0, backend: str = "torch"):
    """(plain, qknorm): the two decode calls of one point over one cache, through ``backend``."""
    from qkmla.ops.mla_decode import mla_decode_with_kvcache

    plain, rows, scalars, table, q_lat, q_rope, lengths, scale = point_inputs(layout, context, batch, seed)
    return (lambda: mla_decode_with_kvcache(q_lat, q_rope, plain, table, lengths, softmax_scale=scale, backend=backend),
            lambda: mla_decode_with_kvcache(q_lat, q_rope, rows, table, lengths, scale_cache=scalars,
                                            softmax_scale=scale, backend=backend))


def default_backends() -> list[str]:
    from qkmla.ops.mla_decode.cpu_kernel import cpu_unsupported_for

    return ["torch"] + (["cpu"] if cpu_unsupported_for("cpu", D_C, D_R, torch.bfloat16) is None else [])


def paired(plain, qknorm, reps: int, names: tuple = ("plain", "qknorm"), clock=time.thread_time) -> dict:
    """Thread CPU time (or ``clock``) of both calls, in turn (order alternating), after one warm-up
    call each: the medians as ``<name>_ms`` and the median per-pair ratio second / first."""
    first, second = names
    plain(), qknorm()
    times = {first: [], second: []}
    for i in range(reps):
        for name, f in ((first, plain), (second, qknorm))[:: 1 if i % 2 == 0 else -1]:
            start = clock()
            f()
            times[name].append(clock() - start)
    ratios = [b / a for a, b in zip(times[first], times[second])]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    return {f"{first}_ms": round(statistics.median(times[first]) * 1e3, 3),
            f"{second}_ms": round(statistics.median(times[second]) * 1e3, 3),
            f"{second}_over_{first}": round(statistics.median(ratios), 4),
            f"{second}_over_{first}_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)]}


def backend_at(rev: str):
    """``torch_mla_decode`` of the torch backend at git revision ``rev``, loaded beside the current
    one (its relative imports resolve against today's package). Raises ValueError naming
    ``--baseline`` when git cannot show the file."""
    path = "src/qkmla/ops/mla_decode/torch_impl.py"
    shown = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    if shown.returncode != 0:
        raise ValueError(f"--baseline: git cannot show {path} at {rev!r}: {shown.stderr.strip()}")
    module = types.ModuleType("qkmla.ops.mla_decode._baseline_torch_impl")
    module.__package__ = "qkmla.ops.mla_decode"
    # Its custom ops stay undecorated: registered again under their names, they would replace
    # the current ones for the whole process.
    with unittest.mock.patch.object(torch.library, "custom_op", _undecorated):
        exec(compile(shown.stdout, f"{rev}:{path}", "exec"), module.__dict__)
    return module.torch_mla_decode


def _undecorated(name, fn=None, /, **kwargs):
    """A stand-in for ``torch.library.custom_op`` that leaves the function as it is (with a
    ``register_fake`` that registers nothing)."""
    def keep(f):
        f.register_fake = lambda fake: fake
        return f
    return keep if fn is None else keep(fn)


def baseline_calls(decode_at_rev, context: int, batch: int, seed: int = 0) -> dict:
    """{variant: (baseline call, current call)} over one row-layout cache: the torch backends
    called directly (the op's argument checks are the same for both)."""
    from qkmla.ops.mla_decode.torch_impl import torch_mla_decode

    plain, rows, scalars, table, q_lat, q_rope, lengths, scale = point_inputs("row", context, batch, seed)
    reads = {"plain": (plain, None), "qknorm": (rows, scalars)}
    return {variant: tuple((lambda f=f, kv=kv, sc=sc: f(q_lat, q_rope, kv, table, lengths, sc, scale))
                           for f in (decode_at_rev, torch_mla_decode))
            for variant, (kv, sc) in reads.items()}


def profile(plain, qknorm, calls_per_block: int, blocks: int = 6) -> dict:
    """Self CPU time per call of each aten op, µs, for both variants (blocks of calls, interleaved)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    plain(), qknorm()
    per_op = {"plain": collections.Counter(), "qknorm": collections.Counter()}
    for i in range(blocks):
        for name, f in (("plain", plain), ("qknorm", qknorm))[:: 1 if i % 2 == 0 else -1]:
            with profiler(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(calls_per_block):
                    f()
            for event in prof.key_averages():
                per_op[name][event.key] += event.self_cpu_time_total / (blocks * calls_per_block)
    ops = sorted(set(per_op["plain"]) | set(per_op["qknorm"]), key=lambda k: -max(per_op["plain"][k],
                                                                                per_op["qknorm"][k]))
    return {"total_us": {name: round(sum(c.values()), 1) for name, c in per_op.items()},
            "ops_us": [{"op": op, "plain": round(per_op["plain"][op], 1), "qknorm": round(per_op["qknorm"][op], 1),
                        "difference": round(per_op["qknorm"][op] - per_op["plain"][op], 1)} for op in ops[:16]]}


def measure(args, result: dict) -> None:
    """Every point on both layouts, and the profile if asked (on one thread), into ``result``
    (the results record)."""
    extra = G / (D_C + D_R)
    rows = []
    for backend in args.backends:
        for context, batch in args.points:
            for layout in LAYOUTS:
                row = {"backend": backend, "layout": layout, "context": context, "batch": batch,
                       **paired(*calls(layout, context, batch, backend=backend), args.reps)}
                rows.append(row)
                low, high = row["qknorm_over_plain_quartiles"]
                print(f"{backend:5s} {layout:5s} {context:6d} x {batch}: plain {row['plain_ms']:9.3f} ms  qknorm "
                      f"{row['qknorm_ms']:9.3f} ms  ratio {row['qknorm_over_plain']:.3f} "
                      f"(quartiles {low:.3f} {high:.3f})", flush=True)
    result.update(reps=args.reps, extra_bytes=round(extra, 4), target=round(1 + extra + 0.02, 4), rows=rows)
    if set(args.backends) == {"torch", "cpu"}:
        result["kernel_rows"] = []
        for context, batch in args.points:
            pairs = zip(calls("row", context, batch, backend="torch"), calls("row", context, batch, backend="cpu"))
            for variant, (torch_call, cpu_call) in zip(("plain", "qknorm"), pairs):
                row = {"variant": variant, "context": context, "batch": batch,
                       **paired(torch_call, cpu_call, args.reps, names=("torch", "cpu"))}
                result["kernel_rows"].append(row)
                print(f"{variant:6s} {context:6d} x {batch}: torch {row['torch_ms']:9.3f} ms  cpu kernel "
                      f"{row['cpu_ms']:9.3f} ms  ratio {row['cpu_over_torch']:.3f}", flush=True)
    if args.baseline is not None:
        decode_at_rev, result["baseline"] = args.decode_at_rev, {"rev": args.baseline, "rows": []}
        for context, batch in args.points:
            for variant, (before, now) in baseline_calls(decode_at_rev, context, batch).items():
                row = {"variant": variant, "context": context, "batch": batch,
                       **paired(before, now, args.reps, names=("baseline", "current"))}
                result["baseline"]["rows"].append(row)
                print(f"{variant:6s} {context:6d} x {batch}: at {args.baseline} {row['baseline_ms']:9.3f} ms  now "
                      f"{row['current_ms']:9.3f} ms  ratio {row['current_over_baseline']:.3f}", flush=True)
    if args.profile is not None:
        context, batch = args.profile
        result["profile"] = {"layout": "row", "context": context, "batch": batch,
                             **profile(*calls("row", context, batch), min(50, max(2, 200_000 // (context * batch))))}
        total = result["profile"]["total_us"]
        print(f"profile row {context} x {batch}: plain {total['plain']} µs, qknorm {total['qknorm']} µs per call")
        for op in result["profile"]["ops_us"][:8]:
            print(f"  {op['op']:28s} {op['plain']:10.1f} {op['qknorm']:10.1f} {op['difference']:+9.1f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", nargs="+", type=point, default=[point(v) for v in DEFAULT_POINTS],
                   metavar="CONTEXTxBATCH")
    p.add_argument("--reps", type=int, default=20, help="pairs of calls per point and layout (default 20)")
    p.add_argument("--backends", nargs="+", choices=("torch", "cpu"), default=None,
                   help="the op's backends to time (default: torch, and cpu where the kernel runs)")
    p.add_argument("--profile", type=point, default=None, metavar="CONTEXTxBATCH")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="also time the torch backend at this git revision against the current one")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps: expected a positive int, got {args.reps}")
    with torch_threads(1):  # thread_time then counts all the op's work
        result, write = start_record(p, args, __spec__.name, argv)
        if args.backends is None:
            args.backends = default_backends()
        elif "cpu" in args.backends and "cpu" not in default_backends():
            from qkmla.ops.mla_decode.cpu_kernel import cpu_unsupported_for

            p.error(f"--backends: {cpu_unsupported_for('cpu', D_C, D_R, torch.bfloat16)}")
        if args.baseline is not None:
            try:
                args.decode_at_rev = backend_at(args.baseline)
            except ValueError as err:
                p.error(str(err))
        measure(args, result)
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
