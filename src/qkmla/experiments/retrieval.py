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
the same fixed learning rate (``LR``; ``--sweep`` is not read).

Measured on each trained model: accuracy and loss on the key digit over ``WINDOWS``
validation windows, each ending at a closing ``#`` whose record opened inside the window, so
the answer is always in view. For the MLA variants the same windows are also read through
compressed latent caches (``compressed_key_scores``): the quantized formats with every token
kept, and StreamingLLM, H2O and SnapKV at kept fractions 1/2, 1/4 and 1/8 (the measured
``kept`` runs a little above those: decoded tokens pile up between evictions, and SnapKV
compresses the prompt only). The key digit sits 12 to 102 tokens before the prediction, so
an eviction policy that drops it turns a model that retrieves back into a guesser: this is
the long-range check the compression experiment could not run. The ``--quick`` size is a
smoke test of the plumbing (a 16-token context that few records fit, six training steps).
"""

from __future__ import annotations

import math
import random
import string
from pathlib import Path

import torch
import torch.nn.functional as F

from ..cache.eviction import H2O, SnapKV, StreamingLLM
from ..train.data import Tokenizer
from .base import Experiment, Options, Report, train_settings
from .compression import decode_logits
from .figures import fmt, pyplot, save, table
from .grid import Run, trained_run
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


def plan(options: Options) -> list[Run]:
    data = str(write_corpus(options.out / "retrieval.txt", retrieval_text()))
    full = {} if options.quick else {"block_size": CONTEXT, "batch_size": BATCH, "model_overrides": {"n_layer": N_LAYER},
                                     "eval_interval": 500, "ckpt_interval": 500, "eval_iters": 10}
    return [Run(f"{v}_s{seed}", v, train_settings(options.quick, STEPS, attn=v, lr=LR, seed=seed, data=data, **full),
                {"lr": LR, "seed": seed})
            for seed in options.seed_list(1) for v in VARIANTS]


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


def report(rows: list[dict], options: Options) -> Report:
    summary = {"chance_accuracy": CHANCE, "chance_loss": math.log(1 / CHANCE)}
    for (variant,), rs in group(rows, "variant").items():
        measured = [r for r in rs if r.get("key_accuracy") is not None]
        s = {"seeds": len(measured), "runs": len(rs), "steps": rs[0].get("steps")}
        for key in ("key_accuracy", "key_loss", "final_val_loss"):
            s[key], s[f"{key}_std"] = mean_std(r.get(key) for r in measured)
        s["key_accuracy_per_seed"] = [r["key_accuracy"] for r in measured]
        if any(r.get("compressed") for r in rs):
            s["compressed"], s["compressed_seeds"] = _compressed(rs)
        summary[variant] = s
    variants = {v: s for v, s in summary.items() if isinstance(s, dict)}
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax.bar(list(variants), [s["key_accuracy"] or 0.0 for s in variants.values()],
           color=[f"C{i}" for i in range(len(variants))])
    ax.axhline(CHANCE, color="k", ls="--", lw=0.8, label="chance (1/10)")
    ax.set_ylim(0, 1)
    ax.set_ylabel("key-digit accuracy")
    ax.set_title("after training, full context (mean over seeds)")
    ax.tick_params(axis="x", labelsize=8)
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
    ax2.legend(fontsize=6)
    figures = [save(fig, options.out / "retrieval.png")]
    header = ["variant", "seeds", "steps", "key accuracy (chance 0.1)", "key loss (chance 2.303)", "final val loss"]
    text = table(header, [[v, s["seeds"], fmt(s["steps"], "d")] + [f"{fmt(s[k], '.3f')} ± {fmt(s[f'{k}_std'], '.3f')}"
                                                          for k in ("key_accuracy", "key_loss", "final_val_loss")]
                          for v, s in variants.items()])
    compressed = {v: s["compressed"] for v, s in variants.items() if "compressed" in s}
    if compressed:
        first = next(iter(compressed.values()))
        by_label = {v: {_label(c): c for c in cs} for v, cs in compressed.items()}
        text += "\nKey accuracy through compressed latent caches (mean over the seeds measured: " + ", ".join(
            f"{v} {variants[v]['compressed_seeds']}" for v in compressed) + "; kept: the fraction of the tokens " \
            "seen that the decoded positions attended to, mean over them):\n\n"
        text += table(["cache", "kept"] + list(compressed),
                      [[_label(c), f"{c['kept']:.3f}"] + [fmt(by_label[v].get(_label(c), {}).get("key_accuracy"), ".3f")
                                                         for v in compressed] for c in first])
    return Report(summary, text, figures)


EXPERIMENT = Experiment("retrieval", "one-hop in-context retrieval (a 1-digit passkey): which variants learn it",
                        plan, report, measure)
