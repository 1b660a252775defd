"""``length``: train at one context length, evaluate at 1x, 2x and 4x it.

QK-norm on the RoPE part has been reported to hurt length extension; this checks plain,
blockwise and unified QK-normed MLA. Validation loss is measured over fixed windows of each
length (the same for every run), over all positions and over the positions past the
training length alone.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..train.data import fixed_windows
from .base import Experiment, Options, Report, sweep_lr, train_settings
from .figures import fmt, pyplot, save, table
from .grid import Run, trained_run
from .results import group, mean_std

VARIANTS = ("mla", "mla-qknorm", "mla-qknorm-unified")
STEPS = 600
FACTORS = (1, 2, 4)
WINDOWS = 48


@torch.no_grad()
def position_losses(model, data: torch.Tensor, length: int, windows: int = WINDOWS, batch: int = 8) -> torch.Tensor:
    """Mean next-token loss at each position 0 .. length-1 over fixed windows. [length]"""
    x, y = fixed_windows(data, windows, length)
    total = torch.zeros(length, dtype=torch.float64)
    for xb, yb in zip(x.split(batch), y.split(batch)):
        logits, _ = model(xb, allow_longer=True)
        loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), yb, reduction="none")
        total += loss.sum(0).double()
    return total / windows


def measure(path: Path) -> dict:
    model, corpus = trained_run(path)
    val = corpus.val
    trained = model.config.block_size
    out = {"train_length": trained}
    for f in FACTORS:
        per_pos = position_losses(model, val, f * trained)
        out[f"loss_{f}x"] = float(per_pos.mean())
        if f > 1:
            out[f"loss_{f}x_past_train"] = float(per_pos[trained:].mean())
        out[f"position_loss_{f}x"] = [round(float(v), 5) for v in per_pos]
    return out


def plan(options: Options) -> list[Run]:
    lr, source = sweep_lr(options)
    return [Run(f"{v}_s{seed}", v, train_settings(options.quick, STEPS, attn=v, lr=lr, seed=seed),
                {"optimizer": "adamw", "lr": lr, "lr_source": source, "seed": seed})
            for seed in options.seed_list(3) for v in VARIANTS]


def report(rows: list[dict], options: Options) -> Report:
    summary = {}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    longest = max(FACTORS)
    for i, ((variant,), rs) in enumerate(group(rows, "variant").items()):
        s = {"seeds": len(rs), "lr": rs[0]["lr"]}
        for f in FACTORS:
            s[f"loss_{f}x"], s[f"loss_{f}x_std"] = mean_std(r.get(f"loss_{f}x") for r in rs)
            if f > 1:
                s[f"loss_{f}x_past_train"], s[f"loss_{f}x_past_train_std"] = mean_std(
                    r.get(f"loss_{f}x_past_train") for r in rs)
        summary[variant] = s
        curves = [r[f"position_loss_{longest}x"] for r in rs if r.get(f"position_loss_{longest}x")]
        if curves:
            mean = torch.tensor(curves).mean(0)
            k = max(1, len(mean) // 64)  # smooth over k positions
            smooth = mean.unfold(0, k, k).mean(1)
            ax.plot([(j + 0.5) * k for j in range(len(smooth))], smooth, color=f"C{i}", label=variant)
    if rows and rows[0].get("train_length"):
        ax.axvline(rows[0]["train_length"], color="k", ls="--", lw=0.8, label="training length")
    ax.set_xlabel("position")
    ax.set_title(f"validation loss by position at {longest}x the training length (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    figures = [save(fig, options.out / "length.png")]
    header = ["variant"] + [f"loss {f}x (all positions)" for f in FACTORS] + \
        [f"loss {f}x, past training length" for f in FACTORS if f > 1]
    lines = [[v] + [f"{fmt(s[f'loss_{f}x'])} ± {fmt(s[f'loss_{f}x_std'])}" for f in FACTORS] +
             [f"{fmt(s[f'loss_{f}x_past_train'])} ± {fmt(s[f'loss_{f}x_past_train_std'])}" for f in FACTORS if f > 1]
             for v, s in summary.items()]
    return Report(summary, table(header, lines), figures)


EXPERIMENT = Experiment("length", "train at one length, evaluate at 1x/2x/4x: plain vs QK-normed MLA",
                        plan, report, measure, reads_sweep=True)
