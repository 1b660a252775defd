"""The design of ``qknorm-vs-clip`` (see the package): its arms, rates, seeds and endpoints, the
runs it plans and what each run measures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ...train.plot import read_metrics
from ...train.rundir import read_status
from ...utils.machine import source_commit
from .. import bracket
from ..base import Options
from ..grid import FINISHED, Run, is_finished, run_dir, trained_run
from ..heldout import last_word_accuracy, split_scores
from ..results import curve, loss_spikes, max_logit_late, paired_difference, run_curves, summarize, values

STEPS = 600
QUICK_STEPS = 8
BATCH, CONTEXT = 32, 128
MODEL = {"n_head": 3, "n_embd": 192}  # on the `cpu` preset: 4 layers
SEEDS = (0, 1, 2)
MAX_SEEDS = 7  # raised from 5 once five seeds left the headline spreads over a third of their means
LR_GRID = (6.25e-4, 1.25e-3, 2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2, 8e-2, 1.6e-1)
MAX_EXTENSIONS = 2
STRESS = (3, 10)
KIMI_TAU = 100.0
TRANSIENT = "mla-qkclip-transient"
# variant -> (TrainConfig fields, the first bracket). The brackets centre on each variant's
# best Muon rate in the 300-step lr-sweep (docs/results.md), on LR_GRID.
VARIANTS = {
    "mla": ({"attn": "mla"}, (5e-3, 1e-2, 2e-2)),
    "mla-qknorm": ({"attn": "mla-qknorm"}, (1e-2, 2e-2, 4e-2)),
    "mla-qknorm-scale": ({"attn": "mla-qknorm", "learnable_logit_scale": True}, (5e-3, 1e-2, 2e-2)),
    "mla-qkclip-100": ({"attn": "mla", "qk_clip": KIMI_TAU}, (5e-3, 1e-2, 2e-2)),
    TRANSIENT: ({"attn": "mla"}, (5e-3, 1e-2, 2e-2)),  # qk_clip: transient_tau(...)
}
QUICK_BRACKET = (1e-2, 2e-2)
# (a, b): a - b is reported; QK-normed MLA first, so a negative difference favours it.
PAIRS = (("mla-qknorm", "mla"), ("mla-qknorm", TRANSIENT), ("mla-qknorm", "mla-qkclip-100"),
         ("mla-qknorm-scale", "mla-qknorm"), (TRANSIENT, "mla"))
METRICS = (("test_loss", "test loss"), ("val_loss_all", "val loss (all windows)"),
           ("test_accuracy", "next-char accuracy"), ("last_word_accuracy", "last-word accuracy"))
SPIKE_WINDOW, SPIKE_NATS = 50, 0.5
CURVE_EVERY = 5
LAST_WORDS = 2048
QUICK_EVAL_TOKENS = 4096  # --quick (debug preset) scores a prefix of each split


# -- settings ---------------------------------------------------------------------------------

def settings(options: Options, variant: str, lr: float, seed: int, tau: Optional[float] = None,
             grad_clip: float = 1.0) -> dict:
    """TrainConfig fields of one run."""
    fields = dict(VARIANTS[variant][0])
    if variant == TRANSIENT:
        fields["qk_clip"] = tau
    common = dict(data="shakespeare", split="plays", optimizer="muon", schedule="wsd", min_lr_ratio=0.0, lr=lr,
                  seed=seed, grad_clip=grad_clip)
    if options.quick:
        size = dict(preset="debug", batch_size=4, block_size=16, steps=QUICK_STEPS, warmup_steps=1, eval_interval=4,
                    eval_iters=2, ckpt_interval=4)
    else:
        size = dict(preset="cpu", model_overrides=dict(MODEL), batch_size=BATCH, block_size=CONTEXT, steps=STEPS,
                    warmup_steps=STEPS // 20, eval_interval=100, eval_iters=8, ckpt_interval=100)
    return {**common, **size, **fields}


def _name(variant: str, lr: float, seed: int, stress: Optional[int] = None) -> str:
    return f"{variant}_lr{lr:g}_s{seed}" + (f"_stress{stress}x" if stress else "")


def choose_rate(losses: dict[float, Optional[float]],
                extensions_left: int) -> tuple[Optional[float], Optional[float]]:
    """:func:`.bracket.choose_rate` on this experiment's :data:`LR_GRID`."""
    return bracket.choose_rate(losses, extensions_left, LR_GRID)


def transient_tau(peak: float, late: float) -> float:
    """A threshold plain MLA's logits cross only for a while: halfway between its late-run
    level and its peak, and at most 0.8 of the peak; two significant figures."""
    tau = min(0.5 * (peak + late), 0.8 * peak)
    return float(f"{tau:.2g}")


# -- what is finished -------------------------------------------------------------------------

def _row(options: Options, run: Run) -> Optional[dict]:
    """The results row of a finished and measured run (its twin's if ``same_as``, which was
    checked against the twin's config when it was set), else None."""
    if run.same_as:
        path = Path(options.out) / "runs" / run.same_as
        finished = (read_status(path) or {}).get("status") in FINISHED
    else:
        path, finished = run_dir(options.out, run), is_finished(options.out, run)
    if not finished or not (path / "measure.json").is_file():
        return None
    return summarize("qknorm-vs-clip", run, options.out)


def _score(row: dict) -> float:
    """What a bracket run is worth: the loss over every validation window; ln V if it diverged."""
    v = row.get("val_loss_all")
    return row["initial_loss"] if v is None or row["status"] != "done" else min(v, row["initial_loss"])


def _with_twin(options: Options, run: Run, variant: str, lr: float, seed: int, grad_clip: float,
               stress: Optional[int], tau: Optional[float]) -> Run:
    """A QK-Clip run becomes ``same_as`` its plain MLA twin when the twin never exceeded tau."""
    if tau is None:
        return run
    twin = Run(_name("mla", lr, seed, stress), "mla", settings(options, "mla", lr, seed, grad_clip=grad_clip))
    row = _row(options, twin)
    if row is not None and row["status"] == "done" and row["peak_max_logit"] is not None \
            and row["peak_max_logit"] <= tau:
        return Run(run.name, run.variant, run.train, run.labels, same_as=twin.name)
    return run


def _tau(variant: str, transient: Optional[float]) -> Optional[float]:
    return transient if variant == TRANSIENT else VARIANTS[variant][0].get("qk_clip")


def _run(options: Options, variant: str, lr: float, seed: int, stage: str, transient: Optional[float],
         stress: Optional[int] = None, base_lr: Optional[float] = None) -> Run:
    grad_clip = 0.0 if stress else 1.0
    tau = _tau(variant, transient)
    labels = {"stage": stage, "optimizer": "muon", "lr": lr, "seed": seed, "grad_clip": grad_clip, "tau": tau,
              "lr_multiple": stress, "chosen_lr": base_lr}
    run = Run(_name(variant, lr, seed, stress), variant, settings(options, variant, lr, seed, tau, grad_clip), labels)
    return _with_twin(options, run, variant, lr, seed, grad_clip, stress, tau)


# -- the plan ---------------------------------------------------------------------------------

def _bracket(options: Options, variant: str, transient: Optional[float]) -> tuple[list[Run], Optional[float]]:
    """The variant's seed-0 bracket runs so far and its chosen rate (None until settled)."""
    first = QUICK_BRACKET if options.quick else VARIANTS[variant][1]
    extensions = 0 if options.quick else MAX_EXTENSIONS
    rates = list(first)
    while True:
        runs = [_run(options, variant, lr, SEEDS[0], "bracket", transient) for lr in rates]
        rows = {lr: _row(options, r) for lr, r in zip(rates, runs)}
        chosen, extra = choose_rate({lr: (_score(r) if r else None) for lr, r in rows.items()},
                                    extensions - (len(rates) - len(first)))
        if extra is None:
            return runs, chosen
        rates.append(extra)


def _transient_from(options: Options, plain_lr: float) -> Optional[float]:
    run = Run(_name("mla", plain_lr, SEEDS[0]), "mla", settings(options, "mla", plain_lr, SEEDS[0]))
    path = run_dir(options.out, run)
    if _row(options, run) is None:
        return None
    rows = read_metrics(path)
    return transient_tau(max(values(rows, "max_logit")), max_logit_late(rows))


def chosen_rates(options: Options) -> tuple[list[Run], dict[str, float], Optional[float]]:
    """The bracket runs planned so far, each variant's chosen rate where settled, and the
    transient tau once plain MLA's bracket has settled."""
    runs, chosen, transient = [], {}, None
    for variant in VARIANTS:
        if variant == TRANSIENT:
            if "mla" not in chosen:
                continue
            transient = _transient_from(options, chosen["mla"])
            if transient is None:
                continue
        r, lr = _bracket(options, variant, transient)
        runs += r
        if lr is not None:
            chosen[variant] = lr
    return runs, chosen, transient


def _paired(rows_a: dict[int, dict], rows_b: dict[int, dict], key: str) -> Optional[dict]:
    seeds = sorted(s for s in rows_a if s in rows_b and rows_a[s].get(key) is not None
                   and rows_b[s].get(key) is not None)
    return paired_difference([rows_a[s][key] - rows_b[s][key] for s in seeds]) if seeds else None


def plan(options: Options) -> list[Run]:
    return _wait_for_twins(options, _plan(options))


def _twin_name(run: Run) -> Optional[str]:
    """The plain MLA run a QK-Clip run would repeat if the clip never fired."""
    if run.train.get("qk_clip") is None:
        return None
    return _name("mla", run.labels["lr"], run.labels["seed"], run.labels["lr_multiple"])


def _wait_for_twins(options: Options, runs: list[Run]) -> list[Run]:
    """QK-Clip runs whose plain twin is planned but not finished yet are left out until it
    is: the twin may show that they need no training (several workers would otherwise
    start both at once)."""
    pending = {r.name for r in runs if _row(options, r) is None}
    return [r for r in runs if r.same_as or _twin_name(r) not in pending]


def _plan(options: Options) -> list[Run]:
    runs, chosen, transient = chosen_rates(options)
    seeds = SEEDS[:2] if options.quick else SEEDS
    for seed in seeds[1:]:
        runs += [_run(options, v, chosen[v], seed, "seed", transient) for v in VARIANTS if v in chosen]
    for mult in (STRESS[-1:] if options.quick else STRESS):
        runs += [_run(options, v, mult * chosen[v], SEEDS[0], "stress", transient, stress=mult, base_lr=chosen[v])
                 for v in VARIANTS if v in chosen]
    if options.quick or len(chosen) < len(VARIANTS):
        return runs
    # Stage 4: more seeds where the paired spread is over a third of the difference.
    main = _main_rows(options, runs, chosen)
    wanted = set()
    for a, b in PAIRS:
        p = _paired(main.get(a, {}), main.get(b, {}), "test_loss")
        if p and p["n"] >= len(SEEDS) and p["sd"] > abs(p["mean"]) / 3:
            wanted |= {a, b}
    for seed in range(len(SEEDS), MAX_SEEDS):
        runs += [_run(options, v, chosen[v], seed, "extra seed", transient) for v in VARIANTS if v in wanted]
    return runs


def _main_rows(options: Options, runs: list[Run], chosen: dict[str, float]) -> dict[str, dict[int, dict]]:
    """{variant: {seed: row}} of the finished runs at each variant's chosen rate, clipping on."""
    out: dict[str, dict[int, dict]] = {}
    for r in runs:
        if r.labels.get("lr_multiple") is None and chosen.get(r.variant) == r.labels["lr"]:
            row = _row(options, r)
            if row is not None:
                out.setdefault(r.variant, {})[r.labels["seed"]] = row
    return out


# -- measuring a run --------------------------------------------------------------------------

def measure(path: Path) -> dict:
    """Held-out scores (skipped for a run that ended non-finite: its checkpoint is the last
    good one, not the end of training), spikes, clipping and thinned curves."""
    rows = read_metrics(path)
    out: dict = {"commit": source_commit(Path(__file__).parent),  # the code that measured it (and trained it)
                 "curves": run_curves(rows, CURVE_EVERY)}
    if any("max_logit_after_clip" in r for r in rows):
        out["curves"]["max_logit_after_clip"] = curve(rows, "max_logit_after_clip", 1)
    out["spike_steps"] = loss_spikes(rows, SPIKE_WINDOW, SPIKE_NATS)
    out["spikes"] = len(out["spike_steps"])
    out["peak_grad_norm"] = max(values(rows, "grad_norm"), default=None)
    out["max_logit_late"] = max_logit_late(rows)
    clipped = [r["step"] for r in rows if r.get("clipped_heads", 0) > 0]
    if any("clipped_heads" in r for r in rows):
        tail = [r for r in rows if r["step"] > 0.8 * len(rows)]
        out.update(first_clip_step=clipped[0] if clipped else None, last_clip_step=clipped[-1] if clipped else None,
                   clipped_fraction_last_20pct=sum(r.get("clipped_heads", 0) > 0 for r in tail) / max(1, len(tail)))
    if (read_status(path) or {}).get("status") != "done":
        return out
    model, corpus = trained_run(path)
    cfg = json.loads((Path(path) / "config.json").read_text())["train"]
    block = model.config.block_size
    val, test = corpus.val, corpus.test
    if cfg["preset"] == "debug":
        val, test = val[:QUICK_EVAL_TOKENS], test[:QUICK_EVAL_TOKENS]
    v = split_scores(model, val, block)
    t = split_scores(model, test, block)
    words = last_word_accuracy(model, test, corpus.tokenizer.decode(test), corpus.tokenizer, block,
                               limit=64 if cfg["preset"] == "debug" else LAST_WORDS)
    out.update(val_loss_all=v["loss"], val_tokens=v["tokens"], val_accuracy=v["accuracy"],
               test_loss=t["loss"], test_perplexity=t["perplexity"], test_accuracy=t["accuracy"],
               test_tokens=t["tokens"], last_word_accuracy=words["accuracy"], last_words=words["words"],
               params=sum(p.numel() for p in model.parameters()))
    return out
