"""Matplotlib helpers shared by the experiment reports (Agg backend, PNG files)."""

from __future__ import annotations

from pathlib import Path

from ..utils.files import write_atomically


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
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
