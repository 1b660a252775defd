"""The design of ``v4-compare`` (see the package and docs/results.md, where the protocol was
committed before any run): its arms and their widths, the rate bracket on the tuning seeds, the
paired main seeds, the order of the runs, and what each run measures."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

import torch

from ...model.gpt import GPT
from ...train.config import TrainConfig
from ...train.plot import read_metrics
from ...train.rundir import read_status
from ...utils.machine import source_commit
from .. import bracket
from ..base import Options
from ..grid import Run, is_finished, run_dir, trained_run
from ..heldout import heldout_scores
from ..qknorm_confirm.design import thin_metrics
from ..results import loss_spikes, max_logit_late, run_curves, summarize, values

__all__ = ["ARMS", "BRACKET", "SEEDS", "TUNING_SEEDS", "all_runs", "arm_model", "chosen_rates", "measure", "plan",
           "settings", "thin_metrics"]

STEPS = 600  # qknorm-vs-clip's horizon: 2.46M tokens, 1.39 tokens per parameter
BATCH, CONTEXT = 32, 128
MODEL = {"n_head": 3, "n_embd": 192}  # on the `cpu` preset: 4 layers; qknorm-vs-clip's model
# arm -> (TrainConfig.attn, its model_overrides). Every arm caches 148 values per token and layer:
# plain MLA d_c 128 + d_r 20; QK-normed MLA d_c 125 + d_r 20 + 3 key scalars (it pays for its
# scalars in latent width); v4 one shared vector of D = 148 (20 of them rotated). v4's query goes
# through V4's LoRA at V4-Flash's proportion (q_lora_rank = hidden / 4 = 48), which is what brings
# its parameters to the MLA arms' (with a direct q_proj of 3 x 148 it would have 12% more).
ARMS = {
    "v4": ("v4", {"q_lora_rank": 48}),
    "mla-qknorm": ("mla-qknorm", {"kv_lora_rank": 125}),
    "mla": ("mla", {}),
}
CACHE_VALUES_PER_TOKEN = 148  # per layer
PARAMS = {"v4": 1_775_068, "mla-qknorm": 1_766_788, "mla": 1_772_480}  # tests/experiments/test_v4_compare.py
PAIRS = (("v4", "mla-qknorm"), ("v4", "mla"), ("mla-qknorm", "mla"))  # a - b: negative favours a
TUNING_SEEDS = (2000, 2001)
SEEDS = tuple(range(2100, 2108))  # no committed experiment used them (nor 2000-2001)
BRACKET = (2.5e-3, 5e-3, 1e-2)  # Muon; every qknorm-vs-clip variant chose 5e-3 at 600 steps
LR_GRID = (1.25e-3, 2.5e-3, 5e-3, 1e-2, 2e-2)  # a best rate at an end adds the next one out, once
MAX_EXTENSIONS = 1
# --quick: the debug preset (4 heads of 16; plain MLA caches d_c 32 + d_r 4 = 36 values, QK-normed
# MLA 28 + 4 + 4 scalars, v4 36) with v4's query LoRA at hidden / 4.
QUICK_OVERRIDES = {"v4": {"q_lora_rank": 16}, "mla-qknorm": {"kv_lora_rank": 28}, "mla": {}}
QUICK = {"steps": 4, "bracket": (2e-2,), "tuning_seeds": (2000,), "seeds": (2100, 2101)}
CURVE_EVERY = 10
SPIKE_WINDOW, SPIKE_NATS = 50, 0.5


def settings(options: Options, arm: str, lr: float, seed: int) -> dict:
    """TrainConfig fields of one run: qknorm-vs-clip's recipe (held-out plays, Muon, WSD with a
    30-step warmup and a 1 - sqrt decay over the last 20%, gradient clipping at 1.0) with the
    arm's attention, and every random tensor drawn by name from the seed (``GPTConfig.init_seed``),
    so the arms of a seed share the embedding and the MLPs, not only the data order."""
    attn, overrides = ARMS[arm]
    common = dict(data="shakespeare", split="plays", optimizer="muon", schedule="wsd", min_lr_ratio=0.0, lr=lr,
                  seed=seed, grad_clip=1.0, attn=attn)
    if options.quick:
        size = dict(data="tiny_shakespeare", split="tail", preset="debug", batch_size=4, block_size=16,
                    steps=QUICK["steps"], warmup_steps=1, eval_interval=2, eval_iters=2, ckpt_interval=2,
                    model_overrides={"init_seed": seed, **QUICK_OVERRIDES[arm]})
    else:
        size = dict(preset="cpu", model_overrides={**MODEL, "init_seed": seed, **overrides}, batch_size=BATCH,
                    block_size=CONTEXT, steps=STEPS, warmup_steps=STEPS // 20, eval_interval=100, eval_iters=8,
                    ckpt_interval=100)
    return {**common, **size}


def arm_model(options: Options, arm: str, seed: int, vocab_size: int = 84) -> GPT:
    """The model a run of ``arm`` starts from, built as the trainer builds it (84: the
    shakespeare corpus's characters)."""
    cfg = TrainConfig(**settings(options, arm, BRACKET[0], seed))
    torch.manual_seed(cfg.seed)
    return GPT(cfg.model_config(vocab_size))


def _name(arm: str, lr: float, seed: int) -> str:
    return f"{arm}_lr{lr:g}_s{seed}"


def _run(options: Options, arm: str, lr: float, seed: int, stage: str) -> Run:
    return Run(_name(arm, lr, seed), arm, settings(options, arm, lr, seed),
               {"stage": stage, "optimizer": "muon", "lr": lr, "seed": seed})


def _score(options: Options, runs: list[Run]) -> Optional[float]:
    """A bracket rate's score: the mean over the tuning seeds of the loss over every window of
    the validation plays (``val_loss_all``); None until every one is finished and measured; a
    run that ended non-finite scores infinite."""
    scores = []
    for run in runs:
        if not is_finished(options.out, run) or not (run_dir(options.out, run) / "measure.json").is_file():
            return None
        row = summarize("v4-compare", run, options.out)
        score = bracket.run_score(row, "val_loss_all")
        scores.append(float("inf") if score is None else score)  # done without a score: nothing to choose it by
    return statistics.fmean(scores)


def chosen_rates(options: Options) -> tuple[list[Run], dict[str, float]]:
    """The bracket runs planned so far (arm by arm, rate by rate, tuning seed by seed) and each
    arm's chosen rate where its bracket has settled."""
    first = QUICK["bracket"] if options.quick else BRACKET
    seeds = QUICK["tuning_seeds"] if options.quick else TUNING_SEEDS
    extensions = 0 if options.quick else MAX_EXTENSIONS
    runs, chosen = [], {}
    for arm in ARMS:
        def losses_of(rates, arm=arm):
            return {lr: _score(options, [_run(options, arm, lr, s, "bracket") for s in seeds]) for lr in rates}

        rates, lr = bracket.settle(first, extensions, LR_GRID, losses_of)
        runs += [_run(options, arm, r, s, "bracket") for r in rates for s in seeds]
        if lr is not None:
            chosen[arm] = lr
    return runs, chosen


def all_runs(options: Options, chosen: dict[str, float]) -> list[Run]:
    """The main runs: seed by seed, every arm at its chosen rate (all three arms settled first,
    so that a partial grid holds whole seeds)."""
    if len(chosen) < len(ARMS):
        return []
    seeds = QUICK["seeds"] if options.quick else SEEDS
    return [_run(options, arm, chosen[arm], s, "main") for s in seeds for arm in ARMS]


def plan(options: Options) -> list[Run]:
    runs, chosen = chosen_rates(options)
    return runs + all_runs(options, chosen)


# -- measuring a run --------------------------------------------------------------------------

def measure(path: Path) -> dict:
    """Held-out scores (validation and test plays, every window; their token-weighted pooled
    loss; next-character accuracy), the cache's values per token, parameters, loss spikes, the
    late max logit and thinned curves. A run that ended non-finite gets no held-out scores."""
    rows = read_metrics(path)
    out: dict = {"commit": source_commit(Path(__file__).parent), "curves": run_curves(rows, CURVE_EVERY),
                 "peak_grad_norm": max(values(rows, "grad_norm"), default=None)}
    out["spike_steps"] = loss_spikes(rows, SPIKE_WINDOW, SPIKE_NATS)
    out["max_logit_late"] = max_logit_late(rows)
    if (read_status(path) or {}).get("status") != "done":
        return out
    model, corpus = trained_run(path)
    cfg = json.loads((Path(path) / "config.json").read_text())["train"]
    out.update(heldout_scores(model, corpus, cfg["preset"]))
    out["params"] = model.num_params()
    caches = model.make_caches(1, 1)
    out["cache_bytes_per_token"] = sum(c.bytes_per_token for c in caches)  # float32, all layers
    return out
