"""Matplotlib helpers shared by the experiment reports (Agg backend, PNG files)."""

from __future__ import annotations

from pathlib import Path

from ..utils.environment import agg_matplotlib
from ..utils.files import write_atomically


def pyplot():
    agg_matplotlib()  # Agg, a junk MPLBACKEND set aside (utils.environment)
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png"))
    finally:
        pyplot().close(fig)
    return path


def fmt(v, spec: str = ".4f") -> str:
    return "–" if v is None else format(v, spec)


def table(header: list[str], rows: list[list]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def curves_by_seed(by_arm: dict, arms, subtitle: str, path: Path) -> Path:
    """Validation loss and max attention logit side by side, one line per run of ``by_arm``
    {arm: {seed: results row with ``curves``}}: a colour per arm (in the order of ``arms``),
    the lowest seed drawn darker; titles end in ``subtitle``. Returns ``path`` (the PNG)."""
    plt = pyplot()
    colors = {a: f"C{i}" for i, a in enumerate(arms)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm, by_seed in by_arm.items():
        for i, (seed, r) in enumerate(sorted(by_seed.items())):
            c = r.get("curves", {})
            kw = dict(color=colors.get(arm, "k"), lw=0.7, alpha=0.8 if i == 0 else 0.35, label=arm if i == 0 else None)
            if c.get("val_loss"):
                axes[0].plot(*zip(*c["val_loss"]), **kw)
            if c.get("max_logit"):
                axes[1].plot(*zip(*c["max_logit"]), **kw)
    for ax, title in zip(axes, ("validation loss (held-out plays)", "max attention logit")):
        ax.set_title(f"{title}, {subtitle}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return save(fig, path)
