"""``qkmla plot``: loss, max attention logit and gradient norm of several runs on one figure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"run_dir: no metrics.jsonl in {run_dir}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> Path:
    """Draw train/val loss, max logit and grad norm against step; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, run in enumerate(run_dirs):
        rows = read_metrics(run)
        label = labels[i] if labels else Path(run).name
        steps = [r["step"] for r in rows]
        line, = axes[0].plot(steps, [r["loss"] for r in rows], lw=0.8, alpha=0.8, label=f"{label} train")
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if val:
            axes[0].plot(*zip(*val), "o-", color=line.get_color(), ms=3, label=f"{label} val")
        axes[1].plot(steps, [r["max_logit"] for r in rows], color=line.get_color(), lw=0.8, label=label)
        axes[2].plot(steps, [r["grad_norm"] for r in rows], color=line.get_color(), lw=0.8, label=label)
    for ax, title in zip(axes, ("loss", "max attention logit", "gradient norm (before clipping)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[2].set_yscale("log")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
