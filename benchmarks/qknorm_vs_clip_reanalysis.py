"""Recompute the readings of the committed ``qknorm-vs-clip`` grid from its per-run files
(``benchmarks/results/experiments/qknorm-vs-clip/runs/*/metrics.jsonl`` and ``measure.json``):
paired differences with two-sided t-test p-values, 95% confidence intervals and Holm
adjustment; when QK-Clip tau = 17 clipped; plain MLA's peak and late-run max logits (the
interval a transient tau must fall in); the peak max logit after a clip (mean and maximum over
seeds); and how often looks at 3, 5 and 7 seeds reject under no effect (optional stopping).

    python -m benchmarks.qknorm_vs_clip_reanalysis --out benchmarks/results/experiments/qknorm-vs-clip/reanalysis.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from qkmla.experiments.results import holm, paired_test, t_quantile
from qkmla.train.plot import read_metrics
from qkmla.utils.files import write_text
from qkmla.utils.machine import source_commit

from .common import ROOT

GRID = ROOT / "benchmarks" / "results" / "experiments" / "qknorm-vs-clip"
SEEDS = range(7)
LR = 0.005
ARMS = {"plain": "mla", "qknorm": "mla-qknorm", "scale": "mla-qknorm-scale", "clip17": "mla-qkclip-transient"}
PAIRS = (("qknorm", "plain"), ("qknorm", "clip17"), ("scale", "qknorm"), ("clip17", "plain"))
METRICS = ("test_loss", "val_loss_all", "test_accuracy", "last_word_accuracy")
STEPS = 600
LAST_FIFTH = 0.8 * STEPS  # steps after 480: the decay phase


def _run(arm: str, seed: int, suffix: str = "", lr: float = LR) -> Path:
    return GRID / "runs" / f"{ARMS[arm]}_lr{lr:g}_s{seed}{suffix}"


def measures(arm: str, seed: int) -> dict:
    return json.loads((_run(arm, seed) / "measure.json").read_text())


def paired(grid_measures: dict) -> dict:
    """Every pair and metric: paired test per seed, Holm within each metric's four pairs and over all 16."""
    out = {}
    for a, b in PAIRS:
        for m in METRICS:
            diffs = [grid_measures[a][s][m] - grid_measures[b][s][m] for s in SEEDS]
            out[f"{a} - {b} | {m}"] = paired_test(diffs)
    for m in METRICS:
        adj = holm({k: v["p"] for k, v in out.items() if k.endswith(f"| {m}")})
        for k, p in adj.items():
            out[k]["holm_p_within_metric"] = p
    for k, p in holm({k: v["p"] for k, v in out.items()}).items():
        out[k]["holm_p_all_16"] = p
    return out


def clipping(path: Path) -> dict:
    """When a QK-Clip run clipped, from every step's ``clipped_heads``, and its peak after a clip."""
    rows = read_metrics(path)
    steps = [r["step"] for r in rows if r.get("clipped_heads", 0) > 0]
    tail = [r for r in rows if r["step"] > LAST_FIFTH]
    after = [r["max_logit_after_clip"] for r in rows if r.get("max_logit_after_clip") is not None]
    return {"steps": len(rows), "clipped_steps": len(steps), "first_clip_step": steps[0] if steps else None,
            "last_clip_step": steps[-1] if steps else None,
            "clipped_in_last_fifth": sum(r.get("clipped_heads", 0) > 0 for r in tail), "last_fifth_steps": len(tail),
            "peak_after_clip": max(after) if after else None}


def plain_logits(path: Path) -> dict:
    """Plain MLA's max-logit path: its peak and where, and its late-run level (last fifth)."""
    rows = read_metrics(path)
    logits = [(r["step"], r["max_logit"]) for r in rows if r.get("max_logit") is not None]
    peak_step, peak = max(logits, key=lambda p: p[1])
    late = [v for s, v in logits if s > LAST_FIFTH]
    stable_late = [v for s, v in logits if STEPS // 2 < s <= LAST_FIFTH]
    return {"peak": peak, "peak_step": peak_step, "late_max_last_fifth": max(late),
            "late_mean_last_tenth": statistics.fmean(v for s, v in logits if s > 0.9 * STEPS),
            "max_steps_301_480": max(stable_late)}


def transient_tau(plain: dict) -> dict:
    """The confirmation's transient tau (docs/results.md): halfway between plain MLA's highest
    late-run level over the seeds (the mean max logit of the last tenth of the steps, the grid's
    ``max_logit_late``) and its lowest peak, to 0.1; with the steps each committed plain run's
    max logit exceeded it (the steps such a clip would first fire at)."""
    late = max(p["late_mean_last_tenth"] for p in plain.values())
    peak = min(p["peak"] for p in plain.values())
    tau = round(0.5 * (late + peak), 1)
    above = {}
    for s in SEEDS:
        steps = [r["step"] for r in read_metrics(_run("plain", s)) if (r.get("max_logit") or 0) > tau]
        above[s] = {"steps_above": len(steps), "first": steps[0] if steps else None,
                    "last": steps[-1] if steps else None,
                    "in_last_fifth": sum(st > LAST_FIFTH for st in steps)}
    return {"highest_late_level": late, "lowest_peak": peak, "tau": tau, "plain_steps_above_tau": above}


def optional_stopping(sims: int = 200_000, looks: tuple = (3, 5, 7), seed: int = 0) -> dict:
    """False-positive rate of a paired t test at 5% looked at after 3, 5 and 7 seeds (stop at the
    first rejection) when the true difference is zero (Gaussian differences)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sims, max(looks), generator=g, dtype=torch.float64)
    rejected = torch.zeros(sims, dtype=torch.bool)
    for n in looks:
        d = x[:, :n]
        t = d.mean(1) / (d.std(1) / n ** 0.5)
        rejected |= t.abs() > t_quantile(0.975, n - 1)
    return {"looks": list(looks), "simulations": sims, "false_positive_rate": float(rejected.double().mean())}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    grid = {arm: {s: measures(arm, s) for s in SEEDS} for arm in ARMS}
    result = {"command": "python -m benchmarks.qknorm_vs_clip_reanalysis " + " ".join(sys.argv[1:] if argv is None
                                                                                     else argv),
              "commit": source_commit(ROOT), "grid": str(GRID.relative_to(ROOT)), "seeds": list(SEEDS), "lr": LR}
    result["means"] = {arm: {m: statistics.fmean(grid[arm][s][m] for s in SEEDS) for m in METRICS} for arm in ARMS}
    result["paired"] = paired(grid)
    # the headline estimate as the seeds were added (seeds 0..n-1), the path the seed rule looked at
    head = [grid["qknorm"][s]["test_loss"] - grid["clip17"][s]["test_loss"] for s in SEEDS]
    result["headline_path"] = {n: {k: paired_test(head[:n])[k] for k in ("mean", "se", "t", "p")}
                               for n in range(3, len(head) + 1)}
    clip = {s: clipping(_run("clip17", s)) for s in SEEDS}
    peaks = [c["peak_after_clip"] for c in clip.values()]
    result["clip17"] = {"per_seed": clip, "peak_after_clip_mean": statistics.fmean(peaks),
                        "peak_after_clip_max": max(peaks)}
    result["clip17_stress"] = {f"{m}x": clipping(_run("clip17", 0, f"_stress{m}x", LR * m)) for m in (3, 10)}
    plain = {s: plain_logits(_run("plain", s)) for s in SEEDS}
    lo = max(p["late_max_last_fifth"] for p in plain.values())
    hi = min(p["peak"] for p in plain.values())
    result["plain_logits"] = {"per_seed": plain, "highest_late_max_last_fifth": lo, "lowest_peak": hi,
                              "interval_late_max_to_peak": [lo, hi] if lo < hi else None}
    result["transient_tau"] = transient_tau(plain)
    result["optional_stopping"] = optional_stopping()
    write_text(args.out, json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
