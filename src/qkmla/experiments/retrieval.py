"""``retrieval``: does each attention variant learn one hop of in-context retrieval?

The text is records ``#D:<filler>#D`` + newline, with D one random digit and the filler 10
to 100 random lowercase letters. The digit after a closing ``#`` is predictable only by
attending back to the record's opening: the most recent earlier digit is the answer. That is
the one step a passkey task (and an evicted cache) tests, without the two-step induction
circuit that a multi-digit key or a verbatim copy needs; the filler is noise (its loss cannot
go below ln 26). Chance on the key is 1/10, a loss of ln 10 = 2.303 nats.

Why it exists: the compression experiment's long-range check needs a model that retrieves,
and its 800-step Shakespeare models never did (``docs/results.md``). This asks, on the
smallest such task, which variants learn retrieval at all at the ``cpu`` preset's width
(here 2 layers of 128 with 4 heads, a 128-token context; about ten CPU-minutes a run): plain
and QK-normed MHA beside plain, QK-normed (blockwise, the paper's) and unified QK-normed
MLA, so that an MLA failure can be told apart from a QK-norm one. Every variant trains at
its own learning rate, chosen at the 3,000-step horizon reported: a bracket of AdamW rates a
factor of about 3 apart around ``LR`` on the first seed (``BRACKET``, extended by up to
``MAX_EXTENSIONS`` rates on ``LR_GRID`` while the best is at an end), scored by the loss on
the key digit over the validation windows; the other seeds train at the chosen rate. The
first runs of this experiment trained every variant at ``LR`` alone, so that a variant that
stayed at chance could have failed for its rate rather than for its attention; the bracket
tells the two apart (``--sweep`` is not read).

Measured on each trained model: accuracy and loss on the key digit over ``WINDOWS``
validation windows, each ending at a closing ``#`` whose record opened inside the window, so
the answer is always in view. For the MLA variants the same windows are also read through
compressed latent caches (``compressed_key_scores``): the quantized formats with every token
kept, and StreamingLLM, H2O and SnapKV at kept fractions 1/2, 1/4 and 1/8 (the measured
``kept`` runs a little above those: decoded tokens pile up between evictions, and SnapKV
compresses the prompt only). The key digit sits 12 to 102 tokens before the prediction, so
an eviction policy that drops it turns a model that retrieves back into a guesser: this is
the long-range check the compression experiment could not run. The ``--quick`` size is a
smoke test of the plumbing (a 16-token context that few records fit, six training steps, a
two-rate bracket without extensions, one seed).
"""

from __future__ import annotations

import math
import random
import string
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ..cache.eviction import H2O, SnapKV, StreamingLLM
from ..train.data import Tokenizer
from .base import Experiment, Options, Report, train_settings
from .bracket import run_score, settle
from .compression import decode_logits
from .figures import fmt, pyplot, save, table
from .grid import Run, is_finished, trained_run
from .passkey import key_targets, random_key, record, write_corpus
from .results import mean_std, summarize

VARIANTS = ("mha", "mha-qknorm", "mla", "mla-qknorm", "mla-qknorm-unified")
STEPS = 3000
CONTEXT = 128
BATCH = 32
LR = 1e-3  # the rate every variant first trained at; runs at it keep their first names
LR_GRID = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
BRACKET = (3e-4, 1e-3, 3e-3)
QUICK_BRACKET = (1e-3, 3e-3)
MAX_EXTENSIONS = 2
N_LAYER = 2
MIN_FILLER, MAX_FILLER = 10, 100
TEXT_CHARS = 1_500_000
SEED = 0
WINDOWS = 256
CHANCE = 0.1
FORMATS = ("dense", "bf16", "fp8", "int8", "int4")  # "bf16": a dense cache stored in bfloat16
POLICIES = {"streaming-llm": lambda f: StreamingLLM(sinks=4, kept_fraction=f, interval=EVERY),
            "h2o": lambda f: H2O(kept_fraction=f, window=8, interval=EVERY),
            "snapkv": lambda f: SnapKV(kept_fraction=f, window=8)}  # windows scaled to the 128-token context
FRACTIONS = (0.5, 0.25, 0.125)
DECODE = 16  # the last tokens of each window go one at a time through the compressed cache
EVERY = 4  # decode steps between evictions (StreamingLLM, H2O)


def retrieval_text(seed: int = SEED) -> str:
    """The whole record text, about ``TEXT_CHARS`` characters (deterministic for a seed)."""
    rng = random.Random(seed)
    records, total = [], 0
    while total < TEXT_CHARS:
        filler = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(MIN_FILLER, MAX_FILLER)))
        records.append(record(random_key(rng, 1), filler))
        total += len(records[-1])
    return "".join(records)


def key_windows(val: torch.Tensor, tok: Tokenizer, count: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` windows of ``context`` tokens spread evenly over ``val``, each ending at a
    closing '#' whose record's key lies inside the window: x [count, context] and the key
    digit that follows each, y [count]."""
    keys = key_targets(val, tok, digits=1, max_distance=context)  # the opening key digit is in view
    ends = [i for i in keys.nonzero().flatten().tolist() if i >= context]
    if len(ends) < count:
        raise ValueError(f"val: {len(ends)} closing keys fit a {context}-token window, fewer than count={count}")
    ends = [ends[round(j * (len(ends) - 1) / max(1, count - 1))] for j in range(count)]
    return torch.stack([val[i - context:i] for i in ends]), val[ends]


@torch.no_grad()
def key_scores(model, x: torch.Tensor, y: torch.Tensor, batch: int = 64) -> dict:
    """Accuracy and mean loss (nats) of the prediction at each window's last position."""
    logits = torch.cat([model(xb)[0][:, -1].float() for xb in x.split(batch)])
    return {"key_accuracy": float((logits.argmax(-1) == y).float().mean()),
            "key_loss": float(F.cross_entropy(logits, y)), "key_windows": len(y)}


@torch.no_grad()
def compressed_key_scores(model, x: torch.Tensor, y: torch.Tensor, decode: int = DECODE) -> list[dict]:
    """The key read through each compressed latent cache (MLA variants): every window's first
    T - decode tokens are prefilled, the policy runs after the prefill (StreamingLLM and H2O
    also every ``EVERY`` decode steps) and the rest go one token at a time; the prediction at
    the last position is scored. ``kept``: the fraction of the tokens seen that the decoded
    positions attended to."""
    out = []
    settings = [(f, None, 1.0) for f in FORMATS] + [("dense", p, fr) for p in POLICIES for fr in FRACTIONS]
    for fmt_name, policy, fraction in settings:
        logits, kept, nbytes = decode_logits(model, x, decode, fmt_name, POLICIES[policy](fraction) if policy else None)
        last = logits[:, -1].float()
        out.append({"format": fmt_name, "policy": policy, "fraction": fraction, "kept": kept, "bytes_per_token": nbytes,
                    "key_accuracy": float((last.argmax(-1) == y).float().mean()), "key_loss": float(F.cross_entropy(last, y))})
    return out


def measure(path: Path) -> dict:
    model, corpus = trained_run(path)
    context = model.config.block_size
    x, y = key_windows(corpus.val, corpus.tokenizer, WINDOWS if context >= CONTEXT else 8, context)
    out = key_scores(model, x, y)
    if model.config.is_mla:
        out["compressed"] = compressed_key_scores(model, x, y, DECODE if context >= CONTEXT else context // 4)
    return out


def _run(options: Options, data: str, variant: str, lr: float, seed: int, stage: str) -> Run:
    full = {} if options.quick else {"block_size": CONTEXT, "batch_size": BATCH, "model_overrides": {"n_layer": N_LAYER},
                                     "eval_interval": 500, "ckpt_interval": 500, "eval_iters": 10}
    name = f"{variant}_s{seed}" if lr == LR else f"{variant}_lr{lr:g}_s{seed}"
    return Run(name, variant, train_settings(options.quick, STEPS, attn=variant, lr=lr, seed=seed, data=data, **full),
               {"lr": lr, "seed": seed, "stage": stage})


def score(row: dict) -> Optional[float]:
    """What a bracket run is worth: its key loss (lower is better); None until it is trained
    and measured; infinite for a run that ended non-finite."""
    return run_score(row, "key_loss")


def _measured_row(options: Options, run: Run) -> dict:
    return summarize("retrieval", run, options.out) if is_finished(options.out, run) else {}


def _settle(first: tuple, quick: bool, losses_of) -> tuple[list[float], Optional[float]]:
    """:func:`.bracket.settle` with this experiment's extensions and grid of rates."""
    return settle(first, 0 if quick else MAX_EXTENSIONS, LR_GRID, losses_of)


def plan(options: Options) -> list[Run]:
    data = str(write_corpus(options.out / "retrieval.txt", retrieval_text()))
    seeds = options.seed_list(2)
    first = QUICK_BRACKET if options.quick else BRACKET
    bracket, chosen = [], {}
    for v in VARIANTS:
        runs_of = lambda rates: [_run(options, data, v, lr, seeds[0], "bracket") for lr in rates]  # noqa: E731
        rates, lr = _settle(first, options.quick, lambda rates: {
            r.labels["lr"]: score(_measured_row(options, r)) for r in runs_of(rates)})
        bracket += runs_of(rates)
        if lr is not None:
            chosen[v] = lr
    # The rates not tried before go first: they are what the bracket adds to the first runs.
    bracket.sort(key=lambda r: r.labels["lr"] == LR)
    return bracket + [_run(options, data, v, chosen[v], seed, "seed") for seed in seeds[1:] for v in VARIANTS
                      if v in chosen]


def _label(s: dict) -> str:
    return s["format"] if s["policy"] is None else f"{s['policy']} {s['fraction']:g}"


def _compressed(rs: list[dict]) -> tuple[list[dict], int]:
    """Each compressed-cache setting with its key accuracy, loss and kept fraction, mean over
    the seeds that measured it; and how many seeds did."""
    per_seed = [{_label(c): c for c in r["compressed"]} for r in rs if r.get("compressed")]
    out = []
    for label, first in per_seed[0].items():
        out.append({k: first[k] for k in ("format", "policy", "fraction", "bytes_per_token")})
        for key in ("key_accuracy", "key_loss", "kept"):
            out[-1][key] = mean_std(seed[label][key] for seed in per_seed if label in seed)[0]
    return out, len(per_seed)


def chosen_rates(rows: list[dict], quick: bool = False) -> dict[str, float]:
    """Each variant's chosen rate, as the plan settles it, from the rows of its bracket; a
    variant whose bracket is still running has none."""
    out = {}
    for v in VARIANTS:
        by_lr = {r["lr"]: score(r) for r in rows if r["variant"] == v and r.get("stage") == "bracket"}
        _, lr = _settle(QUICK_BRACKET if quick else BRACKET, quick, lambda rates: {lr: by_lr.get(lr) for lr in rates})
        if lr is not None:
            out[v] = lr
    return out


def report(rows: list[dict], options: Options) -> Report:
    chosen = chosen_rates(rows, options.quick)
    summary: dict = {"chance_accuracy": CHANCE, "chance_loss": math.log(1 / CHANCE), "chosen_lr": chosen,
                     "bracket_seed": min((r["seed"] for r in rows if r.get("stage") == "bracket"), default=None)}
    for v in VARIANTS:
        bracket = sorted((r for r in rows if r["variant"] == v and r.get("stage") == "bracket"), key=lambda r: r["lr"])
        lr = chosen.get(v)
        at_lr = [r for r in rows if r["variant"] == v and r["lr"] == lr]
        measured = [r for r in at_lr if r.get("key_accuracy") is not None]
        s = {"lr": lr, "seeds": len(measured), "runs": len(at_lr), "steps": next((r.get("steps") for r in measured), None),
             "bracket": {f"{r['lr']:g}": {k: r.get(k) for k in ("status", "key_accuracy", "key_loss", "final_val_loss")}
                         for r in bracket}}
        for key in ("key_accuracy", "key_loss", "final_val_loss"):
            s[key], s[f"{key}_std"] = mean_std(r.get(key) for r in measured)
        s["key_accuracy_per_seed"] = [r["key_accuracy"] for r in measured]
        if any(r.get("compressed") for r in measured):
            s["compressed"], s["compressed_seeds"] = _compressed(measured)
        summary[v] = s
    variants = {v: summary[v] for v in VARIANTS}
    figures = [_figure(variants, options.out / "retrieval.png")]
    rates = sorted({r["lr"] for r in rows if r.get("stage") == "bracket"})
    text = f"Learning-rate bracket (seed {summary['bracket_seed']}; key accuracy, key loss; * chosen: lowest key loss):\n\n"
    text += table(["variant"] + [f"lr {lr:g}" for lr in rates],
                  [[v] + [_bracket_cell(s["bracket"].get(f"{lr:g}"), lr == s["lr"]) for lr in rates]
                   for v, s in variants.items()])
    text += "\nAt each variant's chosen rate (mean ± std over seeds):\n\n"
    header = ["variant", "lr", "seeds", "steps", "key accuracy (chance 0.1)", "key loss (chance 2.303)", "final val loss"]
    text += table(header, [[v, fmt(s["lr"], "g"), s["seeds"], fmt(s["steps"], "d")]
                           + [f"{fmt(s[k], '.3f')} ± {fmt(s[f'{k}_std'], '.3f')}"
                              for k in ("key_accuracy", "key_loss", "final_val_loss")]
                           for v, s in variants.items()])
    compressed = {v: s["compressed"] for v, s in variants.items() if "compressed" in s}
    if compressed:
        first = next(iter(compressed.values()))
        by_label = {v: {_label(c): c for c in cs} for v, cs in compressed.items()}
        text += "\nKey accuracy through compressed latent caches, at each variant's chosen rate (mean over the seeds " \
            "measured: " + ", ".join(f"{v} {variants[v]['compressed_seeds']}" for v in compressed) + "; kept: the " \
            "fraction of the tokens seen that the decoded positions attended to, mean over them):\n\n"
        text += table(["cache", "kept"] + list(compressed),
                      [[_label(c), f"{c['kept']:.3f}"] + [fmt(by_label[v].get(_label(c), {}).get("key_accuracy"), ".3f")
                                                         for v in compressed] for c in first])
    return Report(summary, text, figures)


def _bracket_cell(r: Optional[dict], chosen: bool) -> str:
    if r is None:
        return ""
    if r["status"] != "done" or r.get("key_accuracy") is None:
        return r["status"]
    return f"{r['key_accuracy']:.3f}, {r['key_loss']:.3f}" + ("*" if chosen else "")


def _figure(variants: dict[str, dict], path: Path) -> Path:
    plt = pyplot()
    fig, (ax0, ax, ax2) = plt.subplots(1, 3, figsize=(17, 4.5))
    for i, (v, s) in enumerate(variants.items()):
        pts = sorted((float(lr), b["key_accuracy"]) for lr, b in s["bracket"].items() if b.get("key_accuracy") is not None)
        if pts:
            ax0.plot(*zip(*pts), "o-", color=f"C{i}", label=v, ms=4)
    ax0.set_xscale("log")
    ax0.axhline(CHANCE, color="k", ls="--", lw=0.8)
    ax0.set_ylim(0, 1.02)
    ax0.set_xlabel("AdamW learning rate")
    ax0.set_ylabel("key-digit accuracy")
    ax0.set_title("learning-rate bracket (first seed)")
    ax0.legend(fontsize=7)
    ax.bar(list(variants), [s["key_accuracy"] or 0.0 for s in variants.values()],
           color=[f"C{i}" for i in range(len(variants))])
    ax.axhline(CHANCE, color="k", ls="--", lw=0.8, label="chance (1/10)")
    ax.set_ylim(0, 1)
    ax.set_title("at each variant's chosen rate (mean over seeds)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)
    for i, (v, s) in enumerate(variants.items()):
        for j, policy in enumerate(POLICIES):
            pts = [c for c in s.get("compressed", []) if c["policy"] in (None, policy) and c["format"] == "dense"]
            if pts:
                ax2.plot([c["kept"] for c in pts], [c["key_accuracy"] for c in pts], ("o-", "s--", "^:")[j],
                         color=f"C{i}", label=f"{v}, {policy}", ms=4)
    ax2.axhline(CHANCE, color="k", ls="--", lw=0.8)
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("kept: fraction of the tokens seen that the decoded positions attended to (mean)")
    ax2.set_title("MLA variants: key accuracy through an evicting latent cache")
    ax2.grid(alpha=0.3)
    if ax2.get_legend_handles_labels()[0]:  # nothing measured through an evicting cache yet: no legend
        ax2.legend(fontsize=6)
    return save(fig, path)


EXPERIMENT = Experiment("retrieval", "one-hop in-context retrieval (a 1-digit passkey): which variants learn it, "
                        "each at its own learning rate", plan, report, measure, adaptive=True)
