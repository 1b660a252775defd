"""What an experiment is, the training settings they share, and the driver that runs one.

An experiment plans a list of :class:`~qkmla.experiments.grid.Run` from its options, may
measure something on each trained run, and reports: figures (PNG) and a summary (a dict
for ``summary.json`` and a Markdown table for ``summary.md``) computed from the rows of
``results.jsonl`` alone, so a report can be redrawn from the committed results file.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..machine import machine
from .grid import Run, run_grid
from .results import best_lr, read_results, summarize, write_results


@dataclass(frozen=True)
class Options:
    """out: the experiment's directory; quick: the test-sized grid; seeds: seeds per
    variant (None: the experiment's default); workers: processes (0: one per core);
    sweep: an lr-sweep ``results.jsonl`` for experiments that train at each variant's best
    learning rate (default: ``OUT/../lr-sweep/results.jsonl``)."""

    out: Path
    quick: bool = False
    seeds: Optional[int] = None
    workers: int = 0
    sweep: Optional[Path] = None

    def seed_list(self, default: int) -> list[int]:
        n = self.seeds or (1 if self.quick else default)
        return list(range(1, n + 1))

    @property
    def sweep_results(self) -> Path:
        return self.sweep or self.out.parent / "lr-sweep" / "results.jsonl"


@dataclass(frozen=True)
class Report:
    summary: dict
    table: str  # Markdown
    figures: list


@dataclass(frozen=True)
class Experiment:
    name: str
    description: str
    plan: Callable[[Options], list[Run]]
    report: Callable[[list[dict], Options], Report]
    measure: Optional[Callable[[Path], dict]] = None


def train_settings(quick: bool, steps: int, **changes) -> dict:
    """TrainConfig fields shared by the experiments: the ``cpu`` preset (nanoGPT's CPU model,
    4 x 4 x 128, 64-token context) on tiny Shakespeare; the ``debug`` preset for --quick."""
    if quick:
        base = dict(preset="debug", batch_size=4, block_size=16, steps=6, warmup_steps=2, eval_interval=3,
                    eval_iters=2, ckpt_interval=3)
    else:
        base = dict(preset="cpu", batch_size=12, steps=steps, warmup_steps=max(1, steps // 10),
                    eval_interval=100, eval_iters=20, ckpt_interval=100)
    return {**base, **changes}


DEFAULT_LR = 3e-3  # when no lr-sweep results are there to pick from


def sweep_lr(options: Options, variant: str = "mla-qknorm", optimizer: str = "adamw") -> tuple[float, str]:
    """The variant's best lr from the lr-sweep results if present, else DEFAULT_LR; and where
    it came from (recorded in the results)."""
    path = options.sweep_results
    if Path(path).is_file():
        return best_lr(read_results(path), variant, optimizer)[0], f"best {optimizer} lr of {variant} in {path}"
    return DEFAULT_LR, f"default {DEFAULT_LR:g} (no lr-sweep results at {path})"


def run_experiment(experiment: Experiment, options: Options, progress: bool = True,
                   command: Optional[str] = None) -> Report:
    """Plan, train what is not finished, write ``results.jsonl``, figures and summaries.
    ``command`` (the command line that ran it) is recorded in ``summary.json``."""
    out = options.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out: cannot make the experiment directory {out} ({e.strerror})") from None
    runs = experiment.plan(options)
    t0 = time.perf_counter()
    statuses = run_grid(runs, out, options.workers, experiment.measure, progress)
    rows = [summarize(experiment.name, r, out) for r in runs]
    write_results(rows, out / "results.jsonl")
    report = experiment.report(read_results(out / "results.jsonl"), options)
    meta = {"experiment": experiment.name, "command": command, "machine": machine(), "runs": len(runs),
            "runs_trained_now": len(statuses), "wall_seconds_now": time.perf_counter() - t0,
            "cpu_seconds_of_runs": sum(r["seconds"] or 0 for r in rows),
            "errors": [r["run"] for r in rows if r["status"] not in ("done", "non-finite")]}
    (out / "summary.json").write_text(json.dumps({**meta, **report.summary}, indent=1))
    (out / "summary.md").write_text(report.table)
    return report
