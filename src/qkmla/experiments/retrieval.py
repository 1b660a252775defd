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
(here 2 layers of 128 with 4 heads, a 128-token context) in a few CPU minutes: plain and
QK-normed MHA beside plain and QK-normed MLA, so that an MLA failure can be told apart from
a QK-norm one.

Measured on each trained model: accuracy and loss on the key digit over ``WINDOWS``
validation windows, each ending at a closing ``#`` (every record fits in one window, so the
answer is always in view).
"""

from __future__ import annotations

import json
import math
import random
import string
from pathlib import Path

import torch
import torch.nn.functional as F

from ..train.data import Corpus, Tokenizer
from ..train.trainer import load_model
from .base import Experiment, Options, Report, train_settings
from .figures import fmt, pyplot, save, table
from .grid import Run
from .passkey import key_targets, random_key, record, write_corpus
from .results import group, mean_std

VARIANTS = ("mha", "mha-qknorm", "mla", "mla-qknorm", "mla-qknorm-unified")
STEPS = 3000
CONTEXT = 128
BATCH = 32
LR = 1e-3
N_LAYER = 2
MIN_FILLER, MAX_FILLER = 10, 100
TEXT_CHARS = 1_500_000
SEED = 0
WINDOWS = 256
CHANCE = 0.1


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
    closing '#': x [count, context] and the key digit that follows each, y [count]."""
    ends = [i for i in key_targets(val, tok, digits=1).nonzero().flatten().tolist() if i >= context]
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


def measure(path: Path) -> dict:
    model, _ = load_model(path)
    cfg = json.loads((path / "config.json").read_text())["train"]
    corpus = Corpus.load(cfg["data"], cfg["tokenizer"])
    context = model.config.block_size
    x, y = key_windows(corpus.val, corpus.tokenizer, WINDOWS if context >= CONTEXT else 8, context)
    return key_scores(model, x, y)


def plan(options: Options) -> list[Run]:
    data = str(write_corpus(options.out / "retrieval.txt", retrieval_text()))
    full = {} if options.quick else {"block_size": CONTEXT, "batch_size": BATCH, "model_overrides": {"n_layer": N_LAYER},
                                     "eval_interval": 500, "ckpt_interval": 500, "eval_iters": 10}
    return [Run(f"{v}_s{seed}", v, train_settings(options.quick, STEPS, attn=v, lr=LR, seed=seed, data=data, **full),
                {"lr": LR, "seed": seed})
            for seed in options.seed_list(1) for v in VARIANTS]


def report(rows: list[dict], options: Options) -> Report:
    summary = {"chance_accuracy": CHANCE, "chance_loss": math.log(1 / CHANCE)}
    for (variant,), rs in group(rows, "variant").items():
        s = {"seeds": len(rs), "steps": rs[0].get("steps")}
        for key in ("key_accuracy", "key_loss", "final_val_loss"):
            s[key], s[f"{key}_std"] = mean_std(r.get(key) for r in rs)
        summary[variant] = s
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [v for v in summary if isinstance(summary[v], dict)]
    ax.bar(names, [summary[v]["key_accuracy"] or 0.0 for v in names], color=[f"C{i}" for i in range(len(names))])
    ax.axhline(CHANCE, color="k", ls="--", lw=0.8, label="chance (1/10)")
    ax.set_ylim(0, 1)
    ax.set_ylabel("key-digit accuracy")
    ax.set_title("one-hop in-context retrieval after training (mean over seeds)")
    ax.legend(fontsize=8)
    figures = [save(fig, options.out / "retrieval.png")]
    header = ["variant", "seeds", "steps", "key accuracy (chance 0.1)", "key loss (chance 2.303)", "final val loss"]
    lines = [[v, s["seeds"], s["steps"]] + [f"{fmt(s[k], '.3f')} ± {fmt(s[f'{k}_std'], '.3f')}"
                                            for k in ("key_accuracy", "key_loss", "final_val_loss")]
             for v, s in summary.items() if isinstance(s, dict)]
    return Report(summary, table(header, lines), figures)


EXPERIMENT = Experiment("retrieval", "one-hop in-context retrieval (a 1-digit passkey): which variants learn it",
                        plan, report, measure)
