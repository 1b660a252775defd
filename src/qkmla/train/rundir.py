"""A training run's directory: who owns it, what it holds, and what is written there.

``DIR/lock`` holds the owning process's pid and host while a run trains; a second process
on the same directory is refused, and a lock whose process is gone (killed) is stale and
taken over. ``DIR/status.json`` says ``running`` (with the pid) while training and what
happened at the end: ``done``, ``time limit``, ``non-finite`` (a NaN/inf loss, gradient or
weight: the last good checkpoint is kept), ``interrupted`` (Ctrl-C: checkpointed) or
``failed`` (an exception: the error, the step and the last checkpoint). A ``running``
status whose process is gone was killed; the next start says so.

``DIR/metrics.jsonl`` is strict JSON: a non-finite number is written as null and its key
listed under ``non_finite``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Optional

from .checkpoint import FILENAME

RUN_FILES = ("metrics.jsonl", "status.json", "config.json", FILENAME)


def fresh_out(preset: str, attn: str) -> Path:
    """A new directory name for a run started without ``out``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / f"{preset}-{attn}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path("runs") / f"{preset}-{attn}-{stamp}-{n}"
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def read_status(out: Path) -> Optional[dict]:
    try:
        return json.loads((Path(out) / "status.json").read_text())
    except (OSError, ValueError):
        return None


def write_status(out: Path, status: dict) -> None:
    tmp = Path(out) / "status.json.tmp"
    tmp.write_text(json.dumps(clean_json(status), indent=1))
    os.replace(tmp, Path(out) / "status.json")


class RunLock:
    """``with RunLock(out):`` owns ``out`` for this process, or raises ValueError naming the
    process that does. A lock left by a dead process on this host is taken over."""

    def __init__(self, out: Path):
        self.path = Path(out) / "lock"
        self.stale: Optional[dict] = None  # the dead owner's lock, when one was taken over

    def _owner(self) -> Optional[dict]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def __enter__(self) -> "RunLock":
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                owner = self._owner()
                if owner is not None and (owner.get("host") != me["host"] or _alive(int(owner.get("pid", -1)))):
                    raise ValueError(f"out: {self.path.parent} is in use by process {owner.get('pid')} on "
                                     f"{owner.get('host')} (lock file {self.path}); wait for it, or use another --out")
                self.stale = owner or {}
                self.path.unlink(missing_ok=True)  # its owner is gone
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            return self
        raise ValueError(f"out: could not take the lock {self.path}: another process keeps taking it")

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)


def holds_run(out: Path) -> bool:
    return any((Path(out) / f).exists() for f in RUN_FILES)


def prepare(out: Path, resume: bool, overwrite: bool) -> Optional[str]:
    """Check what ``out`` holds against what the run wants; returns a note for the user
    (a killed previous run, leftovers removed) or None.

    Raises:
        ValueError: ``out`` holds a run and neither ``resume`` nor ``overwrite`` is set.
    """
    out = Path(out)
    notes = []
    leftovers = sorted(out.glob(FILENAME + ".tmp*"))  # a checkpoint write that was killed
    for p in leftovers:
        p.unlink()
    if leftovers:
        notes.append(f"removed {len(leftovers)} unfinished checkpoint write(s) ({leftovers[0].name})")
    status = read_status(out)
    if status is not None and status.get("status") == "running":
        notes.append(f"the previous run in {out} was killed (pid {status.get('pid')}, last logged step "
                     f"{last_logged_step(out)}); its last checkpoint is step {status.get('checkpoint_step', 0)}")
    if holds_run(out) and not (resume or overwrite):
        what = f"status {status.get('status')!r} at step {status.get('step')}" if status else "files of a run"
        raise ValueError(f"out: {out} already holds a run ({what}); pass --resume to continue it, --overwrite "
                         "to replace it, or choose a new --out")
    if overwrite:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
    return "; ".join(notes) or None


def clean_json(obj, flagged: Optional[list] = None, key: str = ""):
    """obj with every non-finite float replaced by None (its key appended to ``flagged``)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        if flagged is not None:
            flagged.append(key)
        return None
    if isinstance(obj, dict):
        return {k: clean_json(v, flagged, k if not key else f"{key}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v, flagged, key) for v in obj]
    return obj


def metrics_line(row: dict) -> str:
    """One strict-JSON line of ``metrics.jsonl``; non-finite values are null, listed in ``non_finite``."""
    flagged: list = []
    row = clean_json(row, flagged)
    if flagged:
        row["non_finite"] = sorted(set(flagged))
    return json.dumps(row) + "\n"


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics file up to its first unreadable line (a write cut short by a kill)."""
    rows = []
    try:
        text = Path(path).read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


def last_logged_step(out: Path) -> int:
    rows = read_rows(Path(out) / "metrics.jsonl")
    return rows[-1]["step"] if rows else 0


def truncate_metrics(out: Path, step: int) -> None:
    """Keep the rows up to ``step`` (a resumed run logs the later ones again), dropping a
    partial last line."""
    path = Path(out) / "metrics.jsonl"
    kept = [r for r in read_rows(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def resume_mismatches(stored: dict, config_train: dict, model: dict, tokenizer: dict) -> list[str]:
    """What differs between a stored run (its config.json) and the run now asked for, in the
    fields that define the model or the data."""
    from .config import RESUMABLE

    diffs = [f"{k}: stored {v!r}, now {config_train.get(k)!r}" for k, v in stored.get("train", {}).items()
             if k not in RESUMABLE and k in config_train and config_train[k] != v]
    stored_model = stored.get("model", {})
    diffs += [f"model.{k}: stored {v!r}, now {model.get(k)!r}" for k, v in stored_model.items()
              if model.get(k) != v and not any(d.startswith(f"{k}:") for d in diffs)]
    if stored.get("tokenizer") not in (None, tokenizer):
        diffs.append("tokenizer vocabulary: differs from the stored run's")
    return diffs
