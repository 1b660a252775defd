"""The design of ``qknorm-confirm`` (see the package and docs/results.md, where the protocol
was committed before any run): its arms, seeds, the warmup-stable-decay chains each arm and
seed trains, the order of the runs, what each run measures and what is archived of it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

from ...train.checkpoint import FILENAME
from ...train.plot import read_metrics
from ...train.rundir import read_status
from ...utils.machine import source_commit
from ..base import Options
from ..grid import Run, is_finished, trained_run
from ..heldout import heldout_scores
from ..numerics import GRID_THREADS, numerics, recorded, supersede_other_trajectories
from ..results import loss_spikes, max_logit_late, run_curves, values

LR = 5e-3  # every qknorm-vs-clip variant's chosen Muon rate at 600 steps
TAU_TRANSIENT = 20.6  # reanalysis.json's transient_tau: halfway from plain MLA's late level 19.99 to its lowest peak 21.28
ARMS = {  # arm -> TrainConfig fields
    "mla": {"attn": "mla"},
    "mla-qknorm": {"attn": "mla-qknorm"},
    "mla-qkclip-17": {"attn": "mla", "qk_clip": 17.0},
    f"mla-qkclip-{TAU_TRANSIENT:g}": {"attn": "mla", "qk_clip": TAU_TRANSIENT},
}
PRIMARY_PAIRS = tuple(("mla-qknorm", b) for b in ARMS if b != "mla-qknorm")  # a - b: negative favours QK-norm
ACCURACY_REPLICATION = ("mla-qkclip-17", "mla")  # at 600 steps
SEEDS = tuple(range(1000, 1012))  # no committed experiment used them
HORIZONS = (600, 1200, 2400)
PRIMARY_HORIZON = 2400
DECAY_FRACTION = 0.2  # the decay is the last 20% of each horizon, as qknorm-vs-clip's WSD
WARMUP = 30
RATE_CHECK = {"arms": ("mla", "mla-qknorm"), "lrs": (2.5e-3, 1e-2), "seeds": SEEDS[:2]}
REPRODUCE = {"arms": {"mla": "mla", "mla-qknorm": "mla-qknorm", "mla-qkclip-17": "mla-qkclip-transient"},
             "seeds": tuple(range(7)), "horizon": 600, "first": 1}  # seed 0 first, seeds 1-6 last
MAIN_SEEDS_BEFORE_RATE_CHECK = 4
BATCH, CONTEXT = 32, 128
MODEL = {"n_head": 3, "n_embd": 192}  # on the `cpu` preset: 4 layers; qknorm-vs-clip's model
QUICK = {"horizons": (10, 20), "seeds": (1000, 1001)}
CURVE_EVERY = 10
SPIKE_WINDOW, SPIKE_NATS = 50, 0.5
# The committed runs the reproduction check compares with (a checkout's benchmarks/ beside src/).
COMMITTED = Path(__file__).resolve().parents[4] / "benchmarks" / "results" / "experiments" / "qknorm-vs-clip" / "runs"


def branch_point(horizon: int) -> int:
    """The stable-phase step the decay to ``horizon`` starts from (the trainer's WSD decay start)."""
    return int(horizon * (1 - DECAY_FRACTION))


def settings(options: Options, arm: str, lr: float, seed: int, steps: int, schedule: str) -> dict:
    """TrainConfig fields of one stretch of a chain: ``constant`` (the stable phase, after the
    warmup) or ``wsd`` (a decay branch: constant until :func:`branch_point`, then 1 - sqrt to 0)."""
    common = dict(data="shakespeare", split="plays", optimizer="muon", schedule=schedule, min_lr_ratio=0.0, lr=lr,
                  seed=seed, grad_clip=1.0, steps=steps)
    if options.quick:
        size = dict(data="tiny_shakespeare", split="tail", preset="debug", batch_size=4, block_size=16,
                    warmup_steps=1, eval_interval=5, eval_iters=2, ckpt_interval=5)
    else:
        size = dict(preset="cpu", model_overrides=dict(MODEL), batch_size=BATCH, block_size=CONTEXT,
                    warmup_steps=WARMUP, eval_interval=100, eval_iters=8, ckpt_interval=100)
    return {**common, **size, **ARMS[arm]}


def chain(options: Options, arm: str, lr: float, seed: int, horizons: tuple, stage: str) -> list[Run]:
    """One warmup-stable-decay run of ``arm`` as runs: the stable phase in stretches to each
    branch point, each continuing the one before, and from each a decay to its horizon."""
    base = f"{arm}_lr{lr:g}_s{seed}"
    labels = {"stage": stage, "optimizer": "muon", "lr": lr, "seed": seed, "tau": ARMS[arm].get("qk_clip")}
    runs, previous = [], None
    for horizon in horizons:
        point = branch_point(horizon)
        stable = Run(f"{base}_stable{point}", arm, settings(options, arm, lr, seed, point, "constant"),
                     {**labels, "phase": "stable", "horizon": None, "branch_point": point}, start_from=previous)
        decay = Run(f"{base}_h{horizon}", arm, settings(options, arm, lr, seed, horizon, "wsd"),
                    {**labels, "phase": "decay", "horizon": horizon, "branch_point": point}, start_from=stable.name)
        runs += [stable, decay]
        previous = stable.name
    return runs


def all_runs(options: Options) -> list[Run]:
    """Every run of the grid, in the order they should finish: the reproduction check's seed 0,
    then seed by seed (every arm's whole chain), the rate check after the first
    ``MAIN_SEEDS_BEFORE_RATE_CHECK`` seeds, and the rest of the reproduction check last."""
    if options.quick:
        return [r for s in QUICK["seeds"] for a in ARMS for r in chain(options, a, LR, s, QUICK["horizons"], "main")]
    repro = [(s, a) for s in REPRODUCE["seeds"] for a in REPRODUCE["arms"]]
    first = [r for s, a in repro if s < REPRODUCE["first"]
             for r in chain(options, a, LR, s, (REPRODUCE["horizon"],), "reproduce")]
    main = [[r for a in ARMS for r in chain(options, a, LR, s, HORIZONS, "main")] for s in SEEDS]
    rate = [r for s in RATE_CHECK["seeds"] for a in RATE_CHECK["arms"] for lr in RATE_CHECK["lrs"]
            for r in chain(options, a, lr, s, HORIZONS, "rate check")]
    last = [r for s, a in repro if s >= REPRODUCE["first"]
            for r in chain(options, a, LR, s, (REPRODUCE["horizon"],), "reproduce")]
    k = MAIN_SEEDS_BEFORE_RATE_CHECK
    return first + [r for seed in main[:k] for r in seed] + rate + [r for seed in main[k:] for r in seed] + last


def plan(options: Options) -> list[Run]:
    """:func:`all_runs` less the branches whose run to continue has not finished yet. A finished
    run without its checkpoint (restored from the committed archive, which keeps none) that an
    unfinished branch needs is marked unfinished (its status renamed ``status.no-checkpoint.json``)
    so that it trains again, from its own start; a run that would not be one trajectory with its
    chain under this machine's numerics is superseded (``numerics.supersede_other_trajectories``)
    and trains again."""
    runs = all_runs(options)
    current = numerics(GRID_THREADS)
    while True:
        done = _mark_lost_checkpoints(runs, options.out)
        if not supersede_other_trajectories(runs, options.out, current):
            break
    return [r for r in runs if r.start_from is None or r.start_from in done]


def _mark_lost_checkpoints(runs: list[Run], out: Path) -> set:
    """Mark the finished runs without a checkpoint that an unfinished branch needs (see
    :func:`plan`); returns the names of the finished runs left."""
    root = Path(out) / "runs"
    done = {r.name for r in runs if (read_status(root / r.name) or {}).get("status") == "done"}
    changed = True
    while changed:
        changed = False
        for r in runs:
            parent = r.start_from
            if parent in done and not (root / parent / FILENAME).is_file() and not is_finished(out, r):
                (root / parent / "status.json").replace(root / parent / "status.no-checkpoint.json")
                done.discard(parent)
                changed = True
    return done


# -- measuring a run --------------------------------------------------------------------------

def _clipping(rows: list[dict], point: int) -> dict:
    """When QK-Clip fired (every step's ``clipped_heads``), over the whole history and in the decay."""
    steps = [r["step"] for r in rows if r.get("clipped_heads", 0) > 0]
    decay = [r for r in rows if r["step"] > point]
    return {"clipped_steps": len(steps), "first_clip_step": steps[0] if steps else None,
            "last_clip_step": steps[-1] if steps else None,
            "clipped_decay_steps": sum(r.get("clipped_heads", 0) > 0 for r in decay), "decay_steps": len(decay),
            "peak_max_logit_after_clip_mean_over_clips": statistics.fmean(values(rows, "max_logit_after_clip"))
            if steps else None}


def _reproduction(rows: list[dict], cfg: dict, arm: str) -> Optional[dict]:
    """The branch's per-step training losses against the committed qknorm-vs-clip run's."""
    name = REPRODUCE["arms"].get(arm)
    path = COMMITTED / f"{name}_lr{cfg['lr']:g}_s{cfg['seed']}" / "metrics.jsonl"
    if name is None or cfg["seed"] not in REPRODUCE["seeds"] or not path.is_file():
        return None
    committed = {r["step"]: r["loss"] for r in read_metrics(path.parent)}
    ours = {r["step"]: r["loss"] for r in rows}
    shared = sorted(set(committed) & set(ours))
    return {"committed_run": path.parent.name, "steps_compared": len(shared),
            "losses_equal": bool(shared) and all(committed[s] == ours[s] for s in shared),
            "max_abs_loss_difference": max(abs(committed[s] - ours[s]) for s in shared) if shared else None}


def measure(path: Path) -> dict:
    """A stable stretch: clipping and the peak gradient norm. A decay branch: also held-out
    scores (validation and test plays, every window; their token-weighted pooled loss;
    next-character accuracy), loss spikes, the late max logit, thinned curves, and for the
    reproduction check's seeds the comparison with the committed run."""
    rows = read_metrics(path)
    cfg = json.loads((Path(path) / "config.json").read_text())["train"]
    arm = next(a for a, f in ARMS.items() if all(cfg.get(k) == v for k, v in f.items())
               and (cfg.get("qk_clip") is None) == ("qk_clip" not in f))
    point = branch_point(cfg["steps"]) if cfg["schedule"] == "wsd" else cfg["steps"]
    out: dict = {"commit": source_commit(Path(__file__).parent), "arm": arm, "numerics": recorded(path),
                 "peak_grad_norm": max(values(rows, "grad_norm"), default=None)}
    if cfg.get("qk_clip") is not None:
        out.update(_clipping(rows, point))
    if cfg["schedule"] != "wsd" or (read_status(path) or {}).get("status") != "done":
        return out
    out["max_logit_late"] = max_logit_late(rows)
    out["spike_steps"] = loss_spikes(rows, SPIKE_WINDOW, SPIKE_NATS)
    out["curves"] = run_curves(rows, CURVE_EVERY)
    out["reproduction"] = _reproduction(rows, cfg, arm)
    model, corpus = trained_run(path)
    out.update(heldout_scores(model, corpus, cfg["preset"]))
    out["params"] = sum(p.numel() for p in model.parameters())
    return out


# -- what is archived -------------------------------------------------------------------------

DENSE_KEEP = ("step", "loss", "max_logit", "clipped_heads", "max_logit_after_clip", "step_seconds", "non_finite")
WHOLE_KEEP = DENSE_KEEP + ("lr", "grad_norm", "val_loss", "logit_bound", "logit_scale")
EVAL = ("val_loss", "logit_bound", "logit_scale")


def thin_metrics(rows: list[dict]) -> list[dict]:
    """The per-step rows committed: every step's loss, max logit, clip fields and step time (what
    the results rows and the reproduction check read), whole rows (learning rate, gradient norm,
    evaluations) every ``CURVE_EVERY`` steps, at the last step and at every evaluation."""
    last = len(rows) - 1
    return [{k: v for k, v in r.items() if k in (WHOLE_KEEP if i % CURVE_EVERY == 0 or i == last
                                                 or any(e in r for e in EVAL) else DENSE_KEEP)}
            for i, r in enumerate(rows)]
