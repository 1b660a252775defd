"""Run a grid of training runs, in parallel worker processes, skipping finished ones.

Each run trains into ``OUT/runs/NAME`` with :func:`qkmla.train.trainer.train`. A run counts
as finished when its ``status.json`` says ``done`` (or ``non-finite``: a divergence is a
result) and its stored config equals the planned one; an unfinished run with a checkpoint
resumes from it (resumed runs reproduce the uninterrupted losses), so an interrupted
experiment re-runs nothing it already has. Tiny models use a core badly with several
threads, so each worker runs one thread and the pool runs one worker per core.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import shutil
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..train.data import Corpus
from ..train.rundir import read_status
from ..train.trainer import load_model

FINISHED = ("done", "non-finite")
# TrainConfig fields that say where and how a run is shown, not what it trains.
_NOT_COMPARED = ("out", "resume", "progress", "max_seconds")


@dataclass(frozen=True)
class Run:
    """One training run of an experiment.

    name: directory under ``OUT/runs``; variant: the row label in tables and figures;
    train: TrainConfig fields; labels: extra result columns (optimizer, lr, seed, p, ...);
    same_as: the name of another run of the grid that this one provably repeats step for
    step (e.g. QK-Clip whose threshold the plain run never reached): it is not trained, and
    its results row is that run's.
    start_from: the name of another run of the grid whose final checkpoint this one continues
    (a branch: the decay of a warmup-stable-decay run from its stable phase, or the next stretch
    of the stable phase); it starts from that run's checkpoint and per-step metrics, with this
    run's own ``steps`` and schedule (those may change on resume, ``TrainConfig.RESUMABLE``).
    The other run must be finished first: a plan lists a branch only once it is.
    """

    name: str
    variant: str
    train: dict
    labels: dict = field(default_factory=dict)
    same_as: Optional[str] = None
    start_from: Optional[str] = None


def run_dir(out: Path, run: Run) -> Path:
    return Path(out) / "runs" / run.name


def trained_run(path: Path) -> tuple:
    """(model, corpus) of a finished run directory: the trained GPT and the
    :class:`~qkmla.train.data.Corpus` its config says it trained on, for an experiment's measure."""
    cfg = json.loads((Path(path) / "config.json").read_text())["train"]
    return load_model(path)[0], Corpus.load(cfg["data"], cfg["tokenizer"], split=cfg.get("split", "tail"))


def _same_config(path: Path, train: dict) -> bool:
    try:
        stored = json.loads((path / "config.json").read_text())["train"]
    except (OSError, ValueError, KeyError):
        return False
    return all(stored.get(k) == v for k, v in train.items() if k not in _NOT_COMPARED)


def _finished(path: Path, train: dict) -> bool:
    return (read_status(path) or {}).get("status") in FINISHED and _same_config(path, train)


def is_finished(out: Path, run: Run) -> bool:
    return _finished(run_dir(out, run), run.train)


# What a finished run needs to count as finished and be reported (its checkpoint is not among
# them): a grid longer than one session is resumed in the next from these, committed.
ARCHIVED = ("config.json", "status.json", "metrics.jsonl", "measure.json")


def archive_runs(out: Path, dst: Path, thin: Optional[Callable[[list[dict]], list[dict]]] = None) -> list[str]:
    """Copy every finished run of the grid in ``out`` to ``dst/runs/NAME`` (only :data:`ARCHIVED`
    files, each written to a temporary name and renamed); returns the runs copied. ``thin``
    (an experiment's ``thin_metrics``) maps the per-step rows of ``metrics.jsonl`` to the rows
    committed, for an experiment that archives its metrics thinned."""
    copied = []
    for path in sorted((Path(out) / "runs").glob("*")):
        if (read_status(path) or {}).get("status") not in FINISHED:
            continue
        target = Path(dst) / "runs" / path.name
        target.mkdir(parents=True, exist_ok=True)
        for name in ARCHIVED:
            if (path / name).is_file():
                tmp = target / (name + ".tmp")
                data = (path / name).read_bytes()
                if thin is not None and name == "metrics.jsonl":
                    rows = thin([json.loads(line) for line in data.decode().splitlines() if line.strip()])
                    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
                tmp.write_bytes(data)
                tmp.replace(target / name)
        copied.append(path.name)
    return copied


def restore_runs(src: Path, out: Path) -> list[str]:
    """Put the archived finished runs of ``src/runs`` (:func:`archive_runs`) into the grid at
    ``out`` where it has no directory of that name, so the grid goes on from them instead of
    training them again; returns the runs restored."""
    restored = []
    for path in sorted((Path(src) / "runs").glob("*")):
        target = Path(out) / "runs" / path.name
        if target.exists() or not (path / "status.json").is_file():
            continue
        tmp = target.with_name(target.name + ".restoring")
        tmp.mkdir(parents=True, exist_ok=True)
        for name in ARCHIVED:
            if (path / name).is_file():
                (tmp / name).write_bytes((path / name).read_bytes())
        tmp.replace(target)
        restored.append(path.name)
    return restored


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)
    try:  # Linux: end with the parent, even one killed with SIGKILL, instead of waiting on its pipe
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_branch(parent: Path, path: Path) -> None:
    """Make ``path`` a branch of the finished run in ``parent``: its final checkpoint and its
    per-step metrics copied in (each to a temporary name, then renamed), no config or status,
    so that training ``path`` with ``resume`` continues from the parent's last step."""
    from ..train.checkpoint import FILENAME

    parent, path = Path(parent), Path(path)
    if (read_status(parent) or {}).get("status") != "done" or not (parent / FILENAME).is_file():
        raise ValueError(f"start_from: {parent} is not a finished run with a checkpoint")
    path.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "status.json"):
        (path / name).unlink(missing_ok=True)
    for name in (FILENAME, "metrics.jsonl"):
        tmp = path / (name + ".branching")
        shutil.copyfile(parent / name, tmp)
        tmp.replace(path / name)


def _train_one(train: dict, path: str, measure: Optional[Callable], start_from: Optional[str] = None) -> dict:
    """In a worker: train (resuming a compatible checkpoint, or branching from ``start_from``'s,
    see :class:`Run`) and run the experiment's measurement; errors come back as a status
    instead of killing the grid."""
    from ..train.checkpoint import FILENAME, read_metadata
    from ..train.trainer import TrainConfig, train as train_run

    try:
        path_ = Path(path)
        if _finished(path_, train):  # trained, not yet measured
            status = read_status(path_)
        else:
            resume = (path_ / FILENAME).is_file() and _same_config(path_, train)
            if resume and int(read_metadata(path_ / FILENAME)["step"]) >= train["steps"]:
                resume = False  # trained to the end but its status was lost: its seconds too, so again
            if not resume and start_from is not None:  # a branch not started yet (or started over)
                start_branch(Path(start_from), path_)
                resume = True
            # Not resumable (none or another config's checkpoint): what is there is replaced.
            status = train_run(TrainConfig(**{**train, "out": path, "progress": False, "resume": resume,
                                              "overwrite": not resume}))
        if measure is not None and status["status"] in FINISHED:
            (path_ / "measure.json").write_text(json.dumps(measure(path_)))
        return status
    except Exception as e:  # noqa: BLE001 - reported per run, the grid goes on
        return {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def worker_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """The pool ``run_grid`` trains in: ``workers`` spawned processes (0: one per CPU core) of
    one thread each. Pass one to several ``run_grid`` calls to start its processes once."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds OpenMP threads
    return concurrent.futures.ProcessPoolExecutor(workers or os.cpu_count() or 1, mp_context=ctx,
                                                  initializer=_init_worker)


def run_grid(runs: list[Run], out: Path, workers: int = 0, measure: Optional[Callable] = None,
             progress: bool = True, pool: Optional[concurrent.futures.ProcessPoolExecutor] = None) -> dict[str, dict]:
    """Train every unfinished run; returns {run name: status} of the runs trained now.

    Args:
        workers: processes (0: one per CPU core).
        measure: ``measure(run_dir) -> dict``, run after training, stored as ``measure.json``.
        pool: a :func:`worker_pool` to train in (kept open); default: one made for this call.
    """
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError("runs: run names must be unique")
    runs = [r for r in runs if r.same_as is None]  # repeats of another run: nothing to train
    todo = [r for r in runs if not is_finished(out, r)]
    # A finished run whose measurement is missing (interrupted after training) measures again.
    todo += [r for r in runs if measure is not None and r not in todo
             and not (run_dir(out, r) / "measure.json").is_file()]
    statuses: dict[str, dict] = {}
    if not todo:
        return statuses
    workers = min(len(todo), workers or os.cpu_count() or 1)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc="runs", unit="run", dynamic_ncols=True)
    own = pool is None
    if own:
        pool = worker_pool(workers)
    try:
        futures = {pool.submit(_train_one, r.train, str(run_dir(out, r)), measure,
                               str(Path(out) / "runs" / r.start_from) if r.start_from else None): r for r in todo}
        for fut in concurrent.futures.as_completed(futures):
            run = futures[fut]
            statuses[run.name] = status = fut.result()
            if status["status"] == "error":
                print(f"run {run.name} failed: {status['error']}", flush=True)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{run.name}: {status['status']}")
    except KeyboardInterrupt:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        if bar is not None:
            bar.close()
        if own:
            pool.shutdown()
    return statuses
