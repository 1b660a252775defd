"""Run a grid of training runs, in parallel worker processes, skipping finished ones.

Each run trains into ``OUT/runs/NAME`` with :func:`qkmla.train.trainer.train`. A run counts
as finished when its ``status.json`` says ``done`` (or ``non-finite``: a divergence is a
result) and its stored config equals the planned one; an unfinished run with a checkpoint
resumes from it (resumed runs reproduce the uninterrupted losses), so an interrupted
experiment re-runs nothing it already has. Tiny models use a core badly with several
threads, so each worker runs one thread and the pool runs one worker per core this process may
use (its CPU affinity: ``taskset`` and cgroup CPU sets are honoured).

Stopping (:func:`stop_requests`): the first SIGINT or SIGTERM starts no new run and is passed
on to the workers, whose runs stop after their current step with a checkpoint (status
``interrupted`` or ``stopped``, as ``qkmla train``'s); a second one is passed on too and stops
them at once (checkpointed if between steps), and workers still busy after
:data:`SECOND_SIGNAL_GRACE` seconds, or at a third signal, are killed. The workers run in their
own process group, so a terminal's Ctrl-C reaches them once, through the parent.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..train.data import Corpus
from ..train.rundir import FINISHED, read_status  # FINISHED: imported from here by the experiments
from ..train.trainer import load_model
from ..utils.errors import TERMINATING_SIGNALS, Stopped, notice, one_line
from ..utils.files import make_directory, write_bytes, write_text
from ..utils.imports import hold_extension_inits
from ..utils.threads import usable_cpus
from .numerics import FILENAME as NUMERICS, GRID_THREADS, SUPERSEDED, check_continues, is_run_name, numerics

SECOND_SIGNAL_GRACE = 10.0  # seconds the runs get to stop after a second signal before they are killed

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


def differences(path: Path, train: dict) -> list[str]:
    """How the run stored in ``path`` was trained otherwise than ``train`` asks ("steps: stored
    600, now 6"); ["no readable config.json"] when there is none to compare."""
    try:
        stored = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))["train"]
    except (OSError, ValueError, KeyError, TypeError):
        return ["no readable config.json"]
    return [f"{k}: stored {stored.get(k)!r}, now {v!r}" for k, v in train.items()
            if k not in _NOT_COMPARED and stored.get(k) != v]


def _same_config(path: Path, train: dict) -> bool:
    return not differences(path, train)


def _finished(path: Path, train: dict) -> bool:
    return (read_status(path) or {}).get("status") in FINISHED and _same_config(path, train)


def is_finished(out: Path, run: Run) -> bool:
    return _finished(run_dir(out, run), run.train)


# What a finished run needs to count as finished and be reported (its checkpoint is not among
# them): a grid longer than one session is resumed in the next from these, committed.
ARCHIVED = ("config.json", "status.json", "metrics.jsonl", "measure.json", NUMERICS)


def _copy_archived(path: Path, target: Path, names: tuple, thin) -> None:
    """The files ``names`` of ``path`` as ``target``'s: those ``path`` lacks are removed from ``target``
    (a run trained again, not measured yet, kept the measure.json of the run it replaced)."""
    target.mkdir(parents=True, exist_ok=True)
    for name in names:
        if (path / name).is_file():
            data = (path / name).read_bytes()
            if thin is not None and name == "metrics.jsonl":
                rows = thin([json.loads(line) for line in data.decode().splitlines() if line.strip()])
                data = "".join(json.dumps(r) + "\n" for r in rows).encode()
            write_bytes(target / name, data)
        elif (target / name).is_file():
            (target / name).unlink()


def _superseded_run(path: Path) -> Optional[str]:
    """The name of the run a superseded folder holds, as its ``superseded.json`` says (its folder may be
    NAME.N), or None when the record is missing, unreadable or names no single directory (".." passed a
    check of Path(name).name == name: dst/runs/.. is dst, whose files were deleted)."""
    try:
        name = json.loads((path / "superseded.json").read_text(encoding="utf-8"))["run"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return name if is_run_name(name) else None


def _superseded_target(path: Path, folder: Path) -> Path:
    """Where the superseded run ``path`` is archived in ``folder``: under its own name, or the first
    ``NAME.N`` that is free or holds this same run (same ``superseded.json``); a grid restored from
    the archive has no superseded/ of its own, so a run superseded again took the name of one already
    archived, and was written over it."""
    record = (path / "superseded.json").read_bytes() if (path / "superseded.json").is_file() else None
    base = _superseded_run(path) or path.name
    n = 1
    while True:
        target = folder / (base if n == 1 else f"{base}.{n}")
        if record is None or not target.exists() or (target / "superseded.json").is_file() \
                and (target / "superseded.json").read_bytes() == record:
            return target
        n += 1


def archive_runs(out: Path, dst: Path, thin: Optional[Callable[[list[dict]], list[dict]]] = None) -> list[str]:
    """Copy every finished run of the grid in ``out`` to ``dst/runs/NAME`` (only :data:`ARCHIVED`
    files, each written to a temporary name and renamed); returns the runs copied. ``thin``
    (an experiment's ``thin_metrics``) maps the per-step rows of ``metrics.jsonl`` to the rows
    committed, for an experiment that archives its metrics thinned. The runs a chain superseded
    (``out/superseded``, :func:`qkmla.experiments.numerics.supersede_other_trajectories`) are
    copied to ``dst/superseded`` with why, and their copy in ``dst/runs`` is removed unless a
    finished run of that name replaced it."""
    copied = []
    for path in sorted((Path(out) / "runs").glob("*")):
        if (read_status(path) or {}).get("status") in FINISHED:
            _copy_archived(path, Path(dst) / "runs" / path.name, ARCHIVED, thin)
            copied.append(path.name)
    for path in sorted((Path(out) / SUPERSEDED).glob("*")):
        # a superseded run is told by its why: a note left beside the runs failed as "Not a directory", and a
        # folder without the record (not moved by the rule) as a missing file
        if not path.is_dir() or not (path / "superseded.json").is_file():
            continue
        _copy_archived(path, _superseded_target(path, Path(dst) / SUPERSEDED), ARCHIVED + ("superseded.json",), thin)
        name = _superseded_run(path)  # which run it was: its stale archived copy goes, unless replaced
        stale = Path(dst) / "runs" / name if name is not None else None
        if stale is not None and stale.is_dir() and stale.name not in copied:
            for item in stale.iterdir():
                if not item.is_dir():  # a folder in it is no archived file: left, with the folder around it
                    item.unlink()
            if not any(stale.iterdir()):
                stale.rmdir()
    return copied


def restore_runs(src: Path, out: Path) -> list[str]:
    """Put the archived finished runs of ``src/runs`` (:func:`archive_runs`) into the grid at
    ``out`` where it has no directory of that name, so the grid goes on from them instead of
    training them again; returns the runs restored."""
    restored = []
    for path in sorted((Path(src) / "runs").glob("*")):
        target = Path(out) / "runs" / path.name
        if os.path.lexists(target) or not (path / "status.json").is_file():  # a link to nothing is taken too
            continue
        tmp = target.with_name(target.name + ".restoring")
        # A restore stopped half way left its temporary folder: start it afresh, so nothing but the archived files
        # (a stray checkpoint.pt) is restored with the run; anything else of that name is named, not replaced.
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp)
        elif os.path.lexists(tmp):
            raise ValueError(f"out: {tmp} is in the way of restoring {path.name} (restore_runs writes the run there "
                             f"first); move it aside")
        tmp.mkdir(parents=True)
        for name in ARCHIVED:
            if (path / name).is_file():
                write_bytes(tmp / name, (path / name).read_bytes())
        tmp.replace(target)
        restored.append(path.name)
    return restored


_WORKER_STOP = None  # in a worker: the pool's stop event (set by the parent at a stop request)
_worker_signals = 0


def _worker_signal(signum, frame) -> None:
    """A signal to an idle worker (or one measuring): the parent's stop event says what to do;
    a second one ends the task at hand."""
    global _worker_signals
    _worker_signals += 1
    if _worker_signals > 1:
        raise KeyboardInterrupt


def _init_worker(stop=None, parent: Optional[int] = None) -> None:
    import torch

    global _WORKER_STOP
    _WORKER_STOP = stop
    torch.set_num_threads(GRID_THREADS)
    try:  # own process group: a terminal's Ctrl-C reaches the parent, which passes it on once
        os.setpgrp()
    except OSError:
        pass
    for name in ("SIGINT", "SIGTERM"):
        signal.signal(getattr(signal, name), _worker_signal)
    hold_extension_inits()  # a request passed on while triton loads (training does) is acted on after it
    # Spawned with them blocked (spawning_workers): one sent while this process was still starting
    # (importing torch) waited, and is handled now, by the handler above.
    try:
        if hasattr(signal, "pthread_sigmask"):  # POSIX; elsewhere spawning_workers blocked nothing
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    except KeyboardInterrupt:  # a second request that waited: no task to end yet, the stop event says it all
        pass
    try:  # Linux: end with the parent, even one killed with SIGKILL, instead of waiting on its pipe
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    # The death signal covers only a parent that dies from now on: one killed while this worker was
    # still importing (seconds on a busy machine) left it waiting on the pool's queue for ever, with
    # the caller's stdout and stderr held open (a pipe reader hung). Its pid is gone by now: leave.
    if parent is not None and os.getppid() != parent:
        os._exit(1)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def spawning_workers():
    """SIGINT and SIGTERM blocked in this thread while it starts worker processes, which inherit the
    mask: a stop request passed on to a worker still importing torch (before :func:`_init_worker`
    installs its handlers) killed it with a KeyboardInterrupt traceback, breaking the pool. The
    worker unblocks them once its handlers are in place; this process's own handler runs at the end
    (or in the meantime, through another thread), so no request is lost."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def start_branch(parent: Path, path: Path) -> None:
    """Make ``path`` a branch of the finished run in ``parent``: its final checkpoint and its
    per-step metrics copied in (each to a temporary name, then renamed), no config or status,
    so that training ``path`` with ``resume`` continues from the parent's last step."""
    from ..train.checkpoint import FILENAME

    parent, path = Path(parent), Path(path)
    if (read_status(parent) or {}).get("status") != "done" or not (parent / FILENAME).is_file():
        raise ValueError(f"start_from: {parent} is not a finished run with a checkpoint")
    # a file (or a link to nothing) in the way, named as the trainer names it: mkdir said "File exists"
    make_directory("out", path, "run directory")
    for name in ("config.json", "status.json"):
        (path / name).unlink(missing_ok=True)
    for name in (FILENAME, "metrics.jsonl"):
        tmp = path / (name + ".branching")
        shutil.copyfile(parent / name, tmp)
        tmp.replace(path / name)


# A run that fails on these fails for every run after it (a full disk or file-size limit, a quota,
# a read-only file system): the grid stops at the first, as one machine error naming the path,
# instead of training each remaining run to the same failure.
MACHINE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS)


def _stopping() -> bool:
    return _WORKER_STOP is not None and _WORKER_STOP.is_set()


def _train_one(train: dict, path: str, measure: Optional[Callable], start_from: Optional[str] = None) -> dict:
    """In a worker: train (resuming a compatible checkpoint, or branching from ``start_from``'s,
    see :class:`Run`) and run the experiment's measurement; errors come back as a status
    instead of killing the grid. After a stop request nothing new starts (status ``not started``)."""
    from ..train.checkpoint import FILENAME, read_metadata
    from ..train.trainer import TrainConfig, train as train_run

    path_ = Path(path)
    if _stopping():
        return {"status": "not started"}
    try:
        if _finished(path_, train):  # trained, not yet measured
            status = read_status(path_)
        else:
            resume = (path_ / FILENAME).is_file() and _same_config(path_, train)
            if resume and int(read_metadata(path_ / FILENAME)["step"]) >= train["steps"]:
                resume = False  # trained to the end but its status was lost: its seconds too, so again
            branch = Path(start_from) if not resume and start_from is not None else None
            check_continues(path_, branch, numerics(), resume)  # the steps it goes on from ran as these will
            if not resume and start_from is not None:  # a branch not started yet (or started over)
                start_branch(Path(start_from), path_)
                resume = True
            # Not resumable (none or another config's checkpoint): what is there is replaced.
            status = train_run(TrainConfig(**{**train, "out": path, "progress": False, "resume": resume,
                                              "overwrite": not resume}))
        if measure is not None and status["status"] in FINISHED and not _stopping():
            write_text(path_ / "measure.json", json.dumps(measure(path_)))
        return status
    except KeyboardInterrupt:  # a second stop request: the trainer wrote the run's status
        return read_status(path_) or {"status": "interrupted"}
    except Exception as e:  # noqa: BLE001 - reported per run, the grid goes on
        status = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        if isinstance(e, OSError) and e.errno in MACHINE_ERRNOS:  # the grid stops on it (run_grid)
            status["os_error"] = [e.errno, e.strerror, e.filename]
            if _WORKER_STOP is not None:  # no run starts after it, here or in another worker, before the parent knows
                _WORKER_STOP.set()
        return status


def default_workers() -> int:
    """One worker per CPU this process may run on (``taskset``, a cgroup's CPU set)."""
    return max(1, len(usable_cpus()))


def worker_pool(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """The pool ``run_grid`` trains in: ``workers`` spawned processes (0: one per usable CPU) of
    one thread each. Pass one to several ``run_grid`` calls to start its processes once."""
    from ..utils.environment import check_hash_seed

    check_hash_seed()  # each worker is a new Python, which reads it first thing
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds OpenMP threads
    stop = ctx.Event()
    pool = concurrent.futures.ProcessPoolExecutor(workers or default_workers(), mp_context=ctx,
                                                  initializer=_init_worker, initargs=(stop, os.getpid()))
    pool.qkmla_stop = stop
    return pool


class GridStopped(Stopped):
    """A grid stopped by SIGINT/SIGTERM; ``statuses``: {run: status} of the runs that ended now."""

    def __init__(self, signal_name: str, statuses: dict, not_started: int, in_flight: Optional[set] = None,
                 unplanned: Optional[int] = None):
        """``in_flight``: the runs the message names (default: every run in ``statuses``); a grid that
        re-plans as runs end has ended many before the stop, which the message need not list.
        ``unplanned``: of an adaptive experiment (its plan redrawn as runs end), the runs of its design
        that no plan lists yet (each waits for the run it continues), counted as not started too; -1
        when its later runs depend on results (a rate chosen), so their number is not known yet."""
        self.statuses, self.signal_name = statuses, signal_name
        self.not_started, self.in_flight = not_started, in_flight
        ended = {name: st["status"] for name, st in statuses.items() if st.get("status") != "not started"
                 and (in_flight is None or name in in_flight)}
        runs = ", ".join(f"{n} ({s}, checkpoint step {statuses[n].get('checkpoint_step', statuses[n].get('step'))})"
                         for n, s in ended.items()) or "no run in flight"
        if unplanned is None:
            left = f"{not_started} run(s) not started"
        elif unplanned < 0:
            left = f"{not_started} run(s) of the plan so far not started (more are planned as runs finish)"
        else:
            left = (f"{not_started + unplanned} run(s) not started ({unplanned} of them planned once the runs they "
                    "continue have finished)")
        super().__init__(f"stopped by {signal_name}: {runs}; {left}; run the same command again to resume",
                         128 + getattr(signal, signal_name, signal.SIGTERM))

    def counting(self, unplanned: int) -> "GridStopped":
        """This stop, its line counting ``unplanned`` runs no plan lists yet (see ``__init__``)."""
        return GridStopped(self.signal_name, self.statuses, self.not_started, self.in_flight, unplanned)


class GridFailed(OSError):
    """A grid stopped by a machine error at one of its runs (:data:`MACHINE_ERRNOS`: a full disk, a
    read-only file system), which the runs after it would meet too: the ``OSError`` itself, for one
    line naming the path, and ``statuses``: {run: status} of the runs that ended, as
    :class:`GridStopped`'s, so that their rows are written before it is reported."""

    def __init__(self, error: OSError, statuses: dict):
        super().__init__(error.errno, error.strerror, error.filename)
        self.statuses = statuses

    def __reduce__(self):  # OSError pickles as cls(*args), which is not this constructor's form
        return GridFailed, (OSError(self.errno, self.strerror, self.filename), self.statuses)


class StopRequests:
    """SIGINT/SIGTERM as a request to the grid (see the module docstring); ``count`` signals so far."""

    def __init__(self):
        self.count, self.signal, self.second_at = 0, None, None
        self.pools: list = []

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        self.count += 1
        if self.count == 1:
            self.signal = name
            again = "Ctrl-C" if name == "SIGINT" else name
            notice(f"qkmla experiment: {name}: starting no new run; the runs in flight stop after their current "
                   f"step with a checkpoint ({again} again to stop them at once)")
        elif self.count == 2:
            self.second_at = time.monotonic()
            notice(f"qkmla experiment: {name} again: stopping the runs now (killed if not stopped within "
                   f"{SECOND_SIGNAL_GRACE:g} s)")
        for pool in self.pools:
            if getattr(pool, "qkmla_stop", None) is not None:
                pool.qkmla_stop.set()
            # SIGHUP is passed on as SIGTERM, the request the workers handle (a SIGHUP killed them)
            passed = signal.SIGTERM if signum == signal.SIGHUP else signum
            self._send(pool, signal.SIGKILL if self.count >= 3 else passed)

    @staticmethod
    def _send(pool, signum) -> None:
        for pid in list(getattr(pool, "_processes", None) or {}):
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def kill(self) -> None:
        for pool in self.pools:
            self._send(pool, signal.SIGKILL)

    @property
    def requested(self) -> bool:
        return self.count > 0


@contextmanager
def stop_requests():
    """``with stop_requests() as stop:`` SIGINT and SIGTERM go to ``stop`` (main thread only;
    elsewhere nothing is installed and ``stop`` never fires)."""
    stop = StopRequests()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        # SIGHUP (a closed terminal) as SIGTERM: it ended the grid on the spot, its runs unrecorded (probe 18)
        for name in ("SIGINT",) + TERMINATING_SIGNALS:
            # SIGTERM or SIGHUP ignored by the process's starter (nohup) stays ignored (as the trainer's _StopRequest)
            if name == "SIGINT" or signal.getsignal(getattr(signal, name)) is not signal.SIG_IGN:
                previous[name] = signal.signal(getattr(signal, name), stop.handle)
    try:
        yield stop
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)



def _done(out: Path, run: Run, measure) -> bool:
    """Trained, and measured where the experiment measures: nothing left to do for ``run``."""
    return is_finished(out, run) and (measure is None or (run_dir(out, run) / "measure.json").is_file())


def _refill(refill: Callable[[dict], list[Run]], statuses: dict, started: set, out: Path, measure, free: int,
            submit: Callable[[Run], concurrent.futures.Future], bar) -> set:
    """Start up to ``free`` of the runs ``refill(statuses)`` returns that are not ``started`` and
    still to train (or to measure); returns their futures."""
    new = set()
    with spawning_workers():
        for r in refill(statuses):
            if len(new) >= free:
                break
            if r.same_as is not None or r.name in started:
                continue
            if _done(out, r, measure):
                continue
            new.add(submit(r))
            started.add(r.name)
            if bar is not None:
                bar.total += 1
                bar.refresh()
    return new


def run_grid(runs: list[Run], out: Path, workers: int = 0, measure: Optional[Callable] = None,
             progress: bool = True, pool: Optional[concurrent.futures.ProcessPoolExecutor] = None,
             stop: Optional[StopRequests] = None,
             refill: Optional[Callable[[dict], list[Run]]] = None) -> dict[str, dict]:
    """Train every unfinished run; returns {run name: status} of the runs trained now.

    Args:
        workers: processes (0: one per usable CPU).
        measure: ``measure(run_dir) -> dict``, run after training, stored as ``measure.json``.
        pool: a :func:`worker_pool` to train in (kept open); default: one made for this call.
        stop: the :func:`stop_requests` that stop the grid (default: its own, for this call).
        refill: for a grid whose runs become trainable as others finish (a branch once its stretch
            has): called with the statuses so far each time a run ends; the runs it returns that this
            call has not started yet are started, in its order, as workers come free. Without it a
            worker whose run ended first idles until the slowest run of the batch ends.

    Raises:
        GridStopped: after a SIGINT/SIGTERM, once the runs in flight have stopped.
        GridFailed: after a run met a machine error (a full disk), once the runs in flight have
            ended; nothing new was started.
    """
    if stop is None:
        with stop_requests() as own_stop:
            return run_grid(runs, out, workers, measure, progress, pool, own_stop, refill)
    planned = list(runs)  # the runs to train as last planned: these, then each refill's
    if refill is not None:
        replan = refill

        def refill(statuses: dict) -> list[Run]:  # noqa: F811 - the caller's, its latest plan kept for a stop
            planned[:] = replan(statuses)
            return planned
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
    slots = workers or default_workers()
    workers = slots if refill is not None else min(len(todo), slots)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc="runs", unit="run", dynamic_ncols=True)
    own = pool is None
    if own:
        pool = worker_pool(workers)
    stop.pools.append(pool)
    killed = False
    machine_error: Optional[OSError] = None
    refill_error: Optional[Exception] = None
    ended_before_stop: set = set()
    try:
        futures = {}

        def submit(r: Run) -> concurrent.futures.Future:
            future = pool.submit(_train_one, r.train, str(run_dir(out, r)), measure,
                                 str(Path(out) / "runs" / r.start_from) if r.start_from else None)
            futures[future] = r
            return future

        with spawning_workers():  # submit starts the pool's processes
            # With a refill, no more runs than workers are handed over: the pool would start queued runs
            # in its own order, and the refill's order (seed by seed) decides which run starts next.
            for r in todo if refill is None else todo[:slots]:
                if stop.requested:
                    break
                submit(r)
        pending = set(futures)
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=0.2,
                                                    return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in done:
                run = futures[fut]
                if fut.cancelled():
                    continue
                try:
                    status = fut.result()
                except concurrent.futures.process.BrokenProcessPool:
                    if not stop.requested:
                        raise
                    status = read_status(run_dir(out, run)) or {"status": "not started"}
                statuses[run.name] = status
                if not stop.requested:
                    ended_before_stop.add(run.name)
                if status.get("os_error") is not None:  # the first is the one line; a run in flight may add more
                    if machine_error is None:
                        machine_error = OSError(*status["os_error"])
                        # Nothing new starts: the queued runs are cancelled, and those already handed
                        # to a worker (up to workers + 1, past cancelling) return "not started", since
                        # the failing worker set the pool's stop event. The runs in flight end on their own.
                        for waiting in pending:
                            waiting.cancel()
                elif status["status"] == "error":
                    print(one_line(f"run {run.name} failed: {status['error']}"), flush=True)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"{run.name}: {status['status']}")
            if done and refill is not None and not stop.requested and machine_error is None and refill_error is None:
                try:
                    pending |= _refill(refill, dict(statuses), {r.name for r in futures.values()}, out, measure,
                                       slots - len(pending), submit, bar)
                except Exception as e:  # noqa: BLE001 - raised below, once the runs in flight have ended
                    # The plan or the report failed while runs train (a full disk, a file moved away): nothing
                    # new starts and the runs in flight end on their own, stop requests still heard. Raised
                    # from here, it left the pool's runs out of the signal handler's reach while the pool's
                    # exit waited for them: Ctrl-C announced a stop that never came.
                    refill_error = e
                    for waiting in pending:
                        waiting.cancel()
            if stop.requested:
                for waiting in pending:
                    waiting.cancel()
                if stop.count >= 3 or (stop.count >= 2 and time.monotonic() - stop.second_at > SECOND_SIGNAL_GRACE):
                    stop.kill()
                    killed = True
                    for waiting in pending:
                        statuses.setdefault(futures[waiting].name, read_status(run_dir(out, futures[waiting]))
                                            or {"status": "not started"})
                    break
    finally:
        stop.pools.remove(pool)
        if bar is not None:
            bar.close()
        if own or killed:
            pool.shutdown(wait=not killed, cancel_futures=True)
    if stop.requested:
        # With a refill, the runs of its latest plan never handed to a worker are not started too: the stop line
        # said "0 run(s) not started" of a grid with runs left to train (only those handed over were counted).
        started = todo if refill is None else list({r.name: r for r in [*futures.values(), *planned]
                                                    if not _done(out, r, measure)}.values())
        not_started = sum(1 for r in started if r.same_as is None
                          and statuses.get(r.name, {}).get("status", "not started") == "not started")
        raise GridStopped(stop.signal, statuses, not_started,
                          None if refill is None else set(statuses) - ended_before_stop)
    if refill_error is not None:
        if isinstance(refill_error, OSError) and refill_error.errno in MACHINE_ERRNOS:
            raise GridFailed(refill_error, statuses) from refill_error
        raise refill_error
    if machine_error is not None:  # main() prints it as one line naming the path, exit 1
        raise GridFailed(machine_error, statuses)
    return statuses
