"""Which numerics a run trained under, and the rule that keeps a chain of runs one trajectory.

A chain (``Run.start_from``: a stable stretch continued by the next, a decay branched from it)
is one training run cut into directories, and its branches are compared as points of one
trajectory. That holds only if every stretch of it ran under the same numerics: torch picks its
float32 kernels by the CPU's instruction set (``torch.backends.cpu.get_cpu_capability()``: AVX2,
AVX-512, ...), and another instruction set, torch release or thread count rounds differently;
training amplifies the difference. The instruction set alone does not pin the rounding: two AVX-512
CPUs (one with AVX-512 BF16/FP16, one without) trained the same 40 steps apart from step 2, since
oneDNN and MKL pick their kernels and blockings by the CPU's features and caches, and Muon's
Newton-Schulz runs in bfloat16. So the record also holds the CPU's identity (``cpu_id``: model,
features and caches, hashed) and the bits of a few of the products training computes
(``roundoff``, under the run's thread count). Under one numerics a run trained again from its start repeats
its per-step losses bit for bit, so a stretch whose checkpoint was lost (the committed archive
keeps none) can be trained again and its finished branches stay valid; under other numerics it
cannot, and a branch from it would continue another trajectory than its siblings'.

Each run of a grid records its numerics (:data:`FILENAME`, archived with the run) when it starts
training. Before a chain grows, :func:`supersede_other_trajectories` moves every run that does not
continue its parent's trajectory under these numerics to ``OUT/superseded/`` (kept, with the
reason, never deleted), so that it trains again; runs recorded before the record existed count as
one numerics of their own (:data:`UNRECORDED`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Optional

from ..train.checkpoint import FILENAME as CHECKPOINT
from ..train.rundir import FINISHED, read_status
from ..utils.files import input_file_problem, write_text

FILENAME = "numerics.json"
SUPERSEDED = "superseded"  # OUT/superseded/NAME: runs moved out of the grid, each with superseded.json
GRID_THREADS = 1  # every grid worker trains on one thread (grid._init_worker)
UNRECORDED = {"recorded": False}  # a run trained before runs recorded their numerics
UNREADABLE = {"recorded": "unreadable"}  # a record that cannot be read: equal to no numerics a run trains under


def numerics(threads: Optional[int] = None) -> dict:
    """What decides a CPU run's rounding: the torch release, the instruction set its kernels were
    picked for, the CPU itself (:func:`cpu_id`), the intra-op thread count (``threads``: the count
    the run will use; default: this process's) and what those give (:func:`roundoff`)."""
    import torch

    threads = torch.get_num_threads() if threads is None else int(threads)
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_id": cpu_id(), "roundoff": roundoff(threads), "threads": threads}


# /proc/cpuinfo's fields that name the CPU and its features (x86, then ARM), not its clock or load
_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags",
               "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "Features")


@functools.lru_cache(maxsize=None)
def cpu_id() -> str:
    """A hash of what the math libraries pick their kernels by: the CPU's model, feature flags and
    cache sizes (the first CPU's, as Linux lists them; ``platform.processor()`` elsewhere)."""
    parts = []
    try:
        first = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").split("\n\n")[0]
    except OSError:
        first = ""
    for line in first.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key in _CPU_FIELDS:
            parts.append(f"{key}={' '.join(sorted(value.split())) if key in ('flags', 'Features') else value}")
    if not parts:
        parts.append(f"{platform.machine()} {platform.processor()}")
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            parts.append(" ".join((index / f).read_text().strip() for f in ("level", "type", "size")))
        except OSError:
            continue
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def roundoff(threads: int) -> str:
    """A hash of the bits of products a training step computes, on ``threads`` threads: float32
    matmuls of a layer's shape and their transposes (forward and backward), causal attention, and a
    bfloat16 matmul (Muon's Newton-Schulz). Two machines that give other bits here round training
    differently; equal bits make the same rounding likely, not certain (the record keeps
    :func:`cpu_id` beside it)."""
    import torch
    import torch.nn.functional as F

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 192, generator=g)
        w = torch.randn(576, 192, generator=g)
        q = torch.randn(8, 3, 128, 64, generator=g)
        with torch.no_grad():
            y = F.linear(x, w)
            outs = [y, y.t() @ x, x.t() @ (y @ w),
                    F.scaled_dot_product_attention(q, q.flip(-1), q, is_causal=True),
                    (w.bfloat16() @ w.t().bfloat16()).float()]
    finally:
        torch.set_num_threads(before)
    digest = hashlib.sha256()
    for out in outs:
        digest.update(out.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def recorded(path: Path) -> dict:
    """The numerics the run in ``path`` recorded; :data:`UNRECORDED` when it has no record, and a
    value equal to no numerics when the record cannot be read."""
    problem = input_file_problem(Path(path) / FILENAME)
    if problem == "does not exist":
        return dict(UNRECORDED)
    if problem is not None:  # a FIFO read as a file waits for a writer forever: the plan hung at its start
        return dict(UNREADABLE)
    try:
        text = (Path(path) / FILENAME).read_text(encoding="utf-8")
    except FileNotFoundError:
        return dict(UNRECORDED)
    except (OSError, ValueError):
        return dict(UNREADABLE)
    try:
        value = json.loads(text)
    except ValueError:
        return dict(UNREADABLE)
    return value if isinstance(value, dict) else dict(UNREADABLE)


def record(path: Path, current: dict) -> None:
    """Write ``current`` as the numerics of the run in ``path`` (temporary name, then renamed)."""
    write_text(Path(path) / FILENAME, json.dumps(current, sort_keys=True) + "\n")


def describe(value: dict) -> str:
    if value.get("recorded") is False:
        return "unrecorded numerics (trained before runs recorded theirs)"
    if value == UNREADABLE:
        return "numerics whose record cannot be read"
    return ", ".join(f"{k} {v}" for k, v in sorted(value.items()))


def _free_name(folder: Path, name: str) -> Path:
    target, n = folder / name, 1
    while os.path.lexists(target):  # a link to nothing is taken too: the move would fail on it, or replace it
        n += 1
        target = folder / f"{name}.{n}"
    return target


def is_run_name(name) -> bool:
    """``name`` is one directory name (no separator, not "", "." or ".."): a run's folder under
    ``OUT/runs`` or ``OUT/superseded``, never a way out of it."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name \
        and not (os.altsep and os.altsep in name)


def _check_chains(runs: list, out: Path) -> None:
    """A ValueError naming ``runs`` unless every name is one directory name, used once, and every
    ``start_from`` names a run listed before it (so no chain is a cycle): checked before any run
    moves. A branch listed before its parent, or continuing no run, failed in the message about its
    parent's numerics (AttributeError: 'NoneType' object has no attribute 'get'); a name with a path
    separator ("../x") reached outside ``out/runs``."""
    seen = set()
    for run in runs:
        name = run.name
        if not is_run_name(name):
            raise ValueError(f"runs: a run's name is one directory name under {Path(out) / 'runs'}, got {name!r}")
        if name in seen:
            raise ValueError(f"runs: run names must be unique, got {name!r} twice")
        if run.start_from is not None and run.start_from not in seen:
            raise ValueError(f"runs: {name} continues {run.start_from!r}, which is not a run listed before it "
                             f"(parents are listed before their branches)")
        seen.add(name)


def supersede_other_trajectories(runs: list, out: Path, current: dict) -> list[str]:
    """Move out of ``out/runs`` every run of ``runs`` (parents listed before their branches) that
    would not be one trajectory with the rest of its chain, and return their names.

    A chain that is still to grow trains under ``current``, so every run it continues must have
    run under ``current`` too (or train again); a finished chain stays as it ran. So a finished
    run stays if its record equals its parent's trajectory (any record, for a first stretch) and,
    when a run after it in its chain is unfinished, equals ``current``; an unfinished run stays if
    it has no steps yet or began under ``current``, and its parent's trajectory is ``current``.
    A run moved goes to ``out/superseded/NAME`` (``NAME.2``, ... when taken) with
    ``superseded.json`` saying why, and trains again; its row in ``results.jsonl`` becomes the
    new run's.

    Raises:
        ValueError, before any run moves: a name that is not one directory name or is used twice, a
        ``start_from`` that names no run listed before it; ``out/superseded`` taken by a file (naming
        ``--out``).
    """
    _check_chains(runs, out)
    root = Path(out) / "runs"
    status = {r.name: (read_status(root / r.name) or {}).get("status") for r in runs}
    finished = {name: s in FINISHED for name, s in status.items()}
    grows = set()  # runs that something unfinished will continue (a non-finite one is continued by nothing)
    for run in reversed(runs):
        if run.start_from is not None and (not finished[run.name] or run.name in grows) \
                and status[run.start_from] != "non-finite":
            grows.add(run.start_from)
    trajectory: dict[str, dict] = {}
    new = set()  # runs whose steps will all be trained anew: what continued them is void
    moved = []
    for run in runs:
        path = root / run.name
        parent = trajectory.get(run.start_from) if run.start_from is not None else None
        if not path.is_dir():
            trajectory[run.name] = current
            new.add(run.name)
            continue
        own = recorded(path)
        started = (path / CHECKPOINT).is_file() or (path / "metrics.jsonl").is_file()
        if run.start_from in new and (finished[run.name] or started):
            why = f"it continued a run of {run.start_from} that was superseded or is gone"
        elif finished[run.name]:
            if run.start_from is not None and own != parent:
                why = f"it ran under {describe(own)}, and {run.start_from} before it under {describe(parent)}"
            elif run.name in grows and own != current:
                why = (f"it ran under {describe(own)}, and the runs that continue it will run under "
                       f"{describe(current)}")
            else:
                trajectory[run.name] = own
                continue
        else:
            if started and own != current and (path / "status.no-checkpoint.json").is_file():
                why = (f"it ran under {describe(own)}, and its checkpoint, which a run after it needs, is gone: "
                       f"trained again under {describe(current)} it would be another run")
            elif started and own != current:
                why = f"it began under {describe(own)}, and would go on under {describe(current)}"
            elif run.start_from is not None and parent != current:
                why = (f"{run.start_from} before it ran under {describe(parent)}, and it runs under "
                       f"{describe(current)}")
            else:
                trajectory[run.name] = current
                if not started:
                    new.add(run.name)
                continue
        folder = Path(out) / SUPERSEDED
        if os.path.lexists(folder) and not folder.is_dir():  # else mkdir's bare "File exists", naming no option
            what = "a symbolic link to nothing" if folder.is_symlink() else "a file"
            raise ValueError(f"--out: {folder} is {what}, not the directory where this grid keeps the runs it trains "
                             f"again ({run.name}: {why}); move it away, or use another --out")
        if not (path / "status.json").exists() and (path / "status.no-checkpoint.json").is_file():
            (path / "status.no-checkpoint.json").replace(path / "status.json")  # it finished where it ran
        target = _free_name(folder, run.name)
        target.parent.mkdir(parents=True, exist_ok=True)
        # The why first, then the move: a kill between the two left a superseded run without its why, which
        # the report leaves out and archive_runs failed on; a why in a run not moved yet is read by nothing.
        write_text(path / "superseded.json", json.dumps({"run": run.name, "why": why, "numerics_now": current,
                                                          "numerics_recorded": own}, indent=1) + "\n")
        path.replace(target)
        print(f"{run.name} superseded (moved to {target}): {why}", flush=True)
        trajectory[run.name] = current
        new.add(run.name)
        moved.append(run.name)
    return moved


def begun_under_other_numerics(path: Path, current: dict) -> Optional[str]:
    """The numerics (described) that the run in ``path`` began under, if it has a checkpoint to
    continue and recorded other numerics than ``current``; else None."""
    path = Path(path)
    if (path / CHECKPOINT).is_file() and (path / FILENAME).is_file() and recorded(path) != current:
        return describe(recorded(path))
    return None


def check_continues(path: Path, start_from: Optional[Path], current: dict, resume: bool = False) -> None:
    """Before a grid worker trains ``path``: refuse to continue, under ``current``, a run
    (``resume``: it goes on from its own checkpoint) or a parent (``start_from``: the run a branch
    starts from) whose steps ran under other recorded numerics (a plan that did not supersede it),
    then record ``current`` as the run's numerics. A run that starts over is not checked.

    Raises:
        ValueError: naming the run and both numerics; naming ``start_from`` when it is not a folder, and the
            record when something other than a file is in its place.
    """
    path = Path(path)
    # Named before anything is read: a numerics.json that is a folder failed in record() as a bare
    # IsADirectoryError, and a parent that is not there was said to have "run under unrecorded numerics".
    if os.path.lexists(path / FILENAME) and not (path / FILENAME).is_file():
        raise ValueError(f"numerics: {path / FILENAME} is not a file (where the run records its numerics); "
                         f"move it aside")
    if start_from is not None and not Path(start_from).is_dir():
        raise ValueError(f"start_from: {start_from} is not a run's folder; {path.name} is a branch that starts from "
                         f"that run's checkpoint, so it must have finished first")
    began = begun_under_other_numerics(path, current) if resume else None
    if began is not None:  # "train it again elsewhere" said neither where nor how: removing it is how
        raise ValueError(f"numerics: {path} was begun under {began} and would continue under {describe(current)}, "
                         f"which round differently; remove it (or move it away, or remove its {CHECKPOINT}) and run "
                         "the experiment again, which trains it from its start")
    if start_from is not None and recorded(Path(start_from)) != current:
        raise ValueError(f"numerics: {start_from} ran under {describe(recorded(Path(start_from)))}, and its branch "
                         f"{path.name} would continue it under {describe(current)}, which round differently; "
                         f"move {start_from} aside and run the experiment again, which trains it anew")
    if not os.path.lexists(path):
        path.mkdir(parents=True)
    if path.is_dir():  # anything else in the way is the trainer's to refuse, naming it
        record(path, current)
