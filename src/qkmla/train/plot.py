"""``qkmla plot``: loss, max attention logit and gradient norm of several runs on one figure."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Sequence

from ..utils.environment import agg_matplotlib
from ..utils.files import input_file_problem, make_directory, write_atomically


class PlotWarning(UserWarning):
    """Something the figure leaves out, which ``qkmla plot`` prints as one line (``warning: ...``)."""


class SkippedLines(PlotWarning):
    """Lines of a metrics file that are not metrics rows, left out of the figure (``qkmla plot``
    prints each as one line)."""


class EmptyCurves(PlotWarning):
    """A run whose logged values of a curve (loss, max logit, gradient norm) are all NaN/inf (null in
    metrics.jsonl), so that curve is empty in the figure: a diverged run's figure was written, exit
    0, with no word that a run had no line in it (probe 18)."""


# The curves drawn: metrics key -> what the figure calls it
CURVES = {"loss": "loss", "max_logit": "max attention logit", "grad_norm": "gradient norm"}


# What a figure file is named: the formats matplotlib writes (an --out without a suffix is a PNG).
# Only such a file, a figure drawn before, is replaced with --overwrite inside another command's
# directory; a run's checkpoint or status is refused (utils.files.check_output).
FIGURE_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp", ".pgf",
                   ".raw", ".rgba", ".avif", ".gif")


def check_figure_name(name: str, out) -> None:
    """Refuse a figure file named with a suffix that is no format matplotlib writes here (``x.txt`` was
    written as a PNG): such a suffix gives the format, no suffix a PNG."""
    agg_matplotlib()  # first: a junk MPLBACKEND fails matplotlib's own import
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    # Path() drops a trailing separator: --out newdir/ wrote a figure file named newdir, where a directory was meant
    if isinstance(out, str) and out.endswith(("/", os.sep)):
        raise ValueError(f"{name}: {out} ends in a path separator, which names a directory; give the figure's file "
                         f"name, as {out}compare.png")
    suffix = Path(out).suffix
    formats = sorted(FigureCanvasAgg.get_supported_filetypes())  # this matplotlib's (gif from 3.11)
    if suffix and suffix[1:].lower() not in formats:
        raise ValueError(f"{name}: {Path(out).name} ends in {suffix}, which is no figure format matplotlib writes; "
                         f"end it in one of {', '.join('.' + f for f in formats)}, or in none for a PNG")


def read_metrics(run_dir: str | Path, skipped: list | None = None) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` (up to a last line cut short by a kill); the
    1-based numbers of the lines that are not rows go into ``skipped`` when it is a list."""
    from .rundir import read_rows

    path = Path(run_dir) / "metrics.jsonl"
    problem = input_file_problem(path)
    if problem == "does not exist":
        raise ValueError(f"run_dir: no metrics.jsonl in {run_dir}")
    if problem is not None:  # a FIFO (read forever), a link to nothing: said as what it is
        raise ValueError(f"run_dir: {path} {problem}")
    return read_rows(path, skipped)


def warn_skipped(path: Path, skipped: list[int]) -> None:
    """A :class:`SkippedLines` warning naming ``path`` and its ``skipped`` lines: a figure drawn
    without some steps says so (a last line cut short by a kill is the usual one)."""
    last = len(path.read_text(errors="replace").splitlines())
    where = ", ".join(map(str, skipped[:5])) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
    if skipped == [last]:
        why = "is cut short (a run killed mid-write leaves it)"
    else:
        why = "is not a metrics row" if len(skipped) == 1 else "are not metrics rows"
        why += " (damaged or edited)"
    warnings.warn(f"{path}: line{'s' if len(skipped) > 1 else ''} {where} of {last} {why}; left out of the figure",
                  SkippedLines, stacklevel=3)


def _points(rows: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) of the rows where ``key`` is a number (null: non-finite, skipped)."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return ([p[0] for p in pts], [p[1] for p in pts]) if pts else ([], [])


LABEL_CHARS = 48  # a longer label is shortened in its middle, where that keeps it apart from the others


def run_labels(run_dirs: Sequence[str | Path]) -> list[str]:
    """One legend label per run, each told apart from the others: the run directory's name, with as many of its
    parent directories as tell two runs of the same name apart (a/run and b/run were both "run"; "." was ""). A
    name past :data:`LABEL_CHARS` keeps its start and end around "...", unless that makes two alike. The same
    directory given twice is told by its place (#2). A name that is not UTF-8 holds surrogate escapes, which
    matplotlib cannot draw (a TypeError from its font code): shown with U+FFFD for the undecodable bytes."""
    parts = [[os.fsencode(p).decode("utf-8", "replace") for p in Path(os.path.abspath(run)).parts[1:]] or ["/"]
             for run in run_dirs]
    depth = [1] * len(parts)
    while True:
        full = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
        alike = [i for i, label in enumerate(full) if depth[i] < len(parts[i])
                 and any(other == label and parts[j] != parts[i] for j, other in enumerate(full))]
        if not alike:
            break
        for i in alike:
            depth[i] += 1
    short = [x if len(x) <= LABEL_CHARS else f"{x[:LABEL_CHARS // 2 - 2]}...{x[-(LABEL_CHARS // 2 - 1):]}"
             for x in full]
    labels = [s if short.count(s) == 1 or full.count(f) > 1 else f for s, f in zip(short, full)]
    return [x if labels[:i].count(x) == 0 else f"{x} #{labels[:i].count(x) + 1}" for i, x in enumerate(labels)]


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> Path:
    """Draw train/val loss, max logit and grad norm against step into exactly the file
    ``out`` names (a PNG without a suffix; a suffix names the format, one of :data:`FIGURE_SUFFIXES`).

    A line of a metrics file that is not a row is left out with a :class:`SkippedLines` warning
    naming the file and the line; a curve of a run with no finite value (a diverged run's loss) with an
    :class:`EmptyCurves` warning naming the run.

    Raises:
        ValueError: a run without metrics rows, runs without one finite value to draw, labels that do
            not match the runs, or ``out`` named with a suffix that is no figure format.
    """
    check_figure_name("out", out)
    agg_matplotlib()
    import matplotlib.pyplot as plt

    if labels is not None and len(labels) != len(run_dirs):
        raise ValueError(f"labels: expected one per run ({len(run_dirs)}), got {len(labels)}")
    runs = []
    for run in run_dirs:
        skipped: list[int] = []
        runs.append((run, read_metrics(run, skipped)))
        if skipped:
            warn_skipped(Path(run) / "metrics.jsonl", skipped)
    empty = [str(run) for run, rows in runs if not rows]
    if empty:
        raise ValueError(f"runs: no metrics rows in {', '.join(empty)} (has the run logged a step yet?)")
    # A curve with no finite value has no line: said per run; with no line in the whole figure, refused (a
    # figure of empty axes answers nothing), before anything is written.
    blank = {run: [name for key, name in CURVES.items() if not _points(rows, key)[0]] for run, rows in runs}
    if all(len(names) == len(CURVES) for names in blank.values()):
        raise ValueError(f"runs: every logged loss, max attention logit and gradient norm of "
                         f"{', '.join(map(str, blank))} is NaN/inf (the run diverged), so the "
                         "figure would have no line; nothing was written")
    for run, names in blank.items():
        rows = dict(runs)[run]
        if names:
            warnings.warn(f"{run}: every logged {', '.join(names)} of its {len(rows)} rows is NaN/inf (the run "
                          f"diverged); {'that curve is' if len(names) == 1 else 'those curves are'} empty in the "
                          "figure", EmptyCurves, stacklevel=2)
    names = run_labels([run for run, _ in runs])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, (run, rows) in enumerate(runs):
        label = labels[i] if labels else names[i]
        line, = axes[0].plot(*_points(rows, "loss"), lw=0.8, alpha=0.8, label=f"{label} train")
        val = _points(rows, "val_loss")
        if val[0]:
            axes[0].plot(*val, "o-", color=line.get_color(), ms=3, label=f"{label} val")
        axes[1].plot(*_points(rows, "max_logit"), color=line.get_color(), lw=0.8, label=label)
        axes[2].plot(*_points(rows, "grad_norm"), color=line.get_color(), lw=0.8, label=label)
    for ax, title in zip(axes, ("loss", "max attention logit", "gradient norm (before clipping)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        # every line by its own label: matplotlib leaves out of a legend it collects a label that starts
        # with "_" (a run named _base had no entry)
        ax.legend(*zip(*[(line, line.get_label()) for line in ax.get_lines()]), fontsize=7)
    axes[1].set_yscale("log")  # bounded and exploding runs differ by orders of magnitude
    axes[2].set_yscale("log")
    with warnings.catch_warnings():  # many runs' legends leave no room to tighten: the figure is drawn
        warnings.filterwarnings("ignore", message="Tight layout not applied")  # as laid out, without a warning
        fig.tight_layout()
    out = Path(out)
    try:
        make_directory("out", out.parent, "figure's directory")
    except ValueError:
        plt.close(fig)
        raise
    suffix = out.suffix[1:].lower()
    fmt = suffix if suffix in fig.canvas.get_supported_filetypes() else "png"  # no suffix appended
    try:  # to a temporary name, then renamed: an interrupted write leaves the old figure
        write_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format=fmt))
    except IsADirectoryError as e:  # a directory by that name
        raise ValueError(f"out: cannot write {out} ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out
