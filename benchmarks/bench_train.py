"""Training step time of every attention variant, side by side (one run, interleaved rounds).

    python -m benchmarks.bench_train [--quick] [--preset cpu] [--out FILE.json] [--overwrite]

A step is forward + backward + AdamW step on one batch, with per-head max-logit tracking on
(as ``qkmla train`` runs it) and, separately for mla-qknorm, with tracking off, so the cost
of measuring is visible. Reports seconds per step (median), tokens/s and the ratio to plain
``mla``. Target: mla-qknorm within 1.10x of mla.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from qkmla.model.gpt import GPT, GPT_PRESETS
from qkmla.train.optim import build_optimizer

from .common import start_record

HERE = Path(__file__).resolve().parent
VARIANTS = ("mla", "mla-qknorm", "mla-qknorm-unified", "mla-l2", "mla-lp", "mha", "gqa", "gqa-qknorm")


def make_step(attn: str, preset: str, batch: int, track: bool):
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS[preset].replace(attn=attn, dropout=0.0))
    for block in model.blocks:
        block.attn.track_max_logits = track
    opt = build_optimizer(model, "adamw", 1e-3)
    T = model.config.block_size
    x = torch.randint(0, model.config.vocab_size, (batch, T))

    def step():
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, batch * T


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--preset", default="cpu", choices=sorted(GPT_PRESETS))
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file (default results/bench_train_cpu.json, with --quick bench_train_cpu_quick.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    args.out = args.out or HERE / "results" / f"bench_train_cpu{'_quick' if args.quick else ''}.json"
    rounds = args.rounds or (3 if args.quick else 15)
    result, write = start_record(p, args, __spec__.name, argv, preset=args.preset, batch=args.batch, rounds=rounds)
    variants = ("mla", "mla-qknorm") if args.quick else VARIANTS
    fns = {v: make_step(v, args.preset, args.batch, True) for v in variants}
    fns["mla-qknorm (no max-logit tracking)"] = make_step("mla-qknorm", args.preset, args.batch, False)
    fns["mla (no max-logit tracking)"] = make_step("mla", args.preset, args.batch, False)
    samples = {k: [] for k in fns}
    for fn, _ in fns.values():
        fn()
    for _ in range(rounds):
        for name, (fn, _) in fns.items():
            fn()  # untimed call after switching variants
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
    info = result["machine"]
    print(f"# {info['cpu']} ({info['cores']} cores), torch {info['torch']}, preset {args.preset}, batch {args.batch}")
    rows = []
    base = statistics.median(samples["mla"])
    for name, (_, tokens) in fns.items():
        s = statistics.median(samples[name])
        rows.append({"variant": name, "seconds_per_step": s, "tokens_per_s": tokens / s, "ratio_to_mla": s / base})
        print(f"{name:<40}{s * 1000:>9.1f} ms{tokens / s:>12,.0f} tok/s{s / base:>8.3f}x")
    result["rows"] = rows
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
