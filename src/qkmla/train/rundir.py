"""A training run's directory: who owns it, what it holds, and what is written there.

``DIR/lock`` is flock-ed by the process that trains there (its pid and host inside); a
second process on the same directory is refused, and the kernel frees the lock of a
process that dies, so a killed run never blocks the next one. ``DIR/status.json`` says ``running`` (with the pid) while training and what
happened at the end: ``done``, ``time limit``, ``non-finite`` (a NaN/inf loss, gradient or
weight: the last good checkpoint is kept), ``interrupted`` (Ctrl-C: checkpointed),
``stopped`` (SIGTERM: checkpointed) or
``failed`` (an exception: the error, the step and the last checkpoint). A ``running``
status whose process is gone was killed; the next start says so.

``DIR/metrics.jsonl`` is strict JSON: a non-finite number is written as null and its key
listed under ``non_finite``.

``DIR/config.json`` is the run's record of its settings, written at every start from the
config (the checkpoint carries the same record). It is read, not obeyed: a resume takes its
settings from the command line and checks them against the checkpoint's. An edit to the file
would be overwritten by the resume, so a resume over an edited (or damaged) one is refused,
naming the settings changed (:func:`record_edits`); ``status.json`` keeps the digests of the
texts the last start wrote (``config_sha256``, and the one before while it writes), which vouch
for a file a resume killed before its first checkpoint left.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Optional

from ..utils.checked import is_int
from ..utils.files import check_own_directory, make_directory, write_text
from .checkpoint import FILENAME, read_metadata

RUN_FILES = ("metrics.jsonl", "status.json", "config.json", FILENAME)
# The statuses of a run that ended for good: nothing left to train (a non-finite run stays as it ended)
FINISHED = ("done", "non-finite")


def fresh_out(preset: str, attn: str) -> Path:
    """A new directory for a run started without ``out``, made here (``runs/PRESET-ATTN-TIME``, ``-2``, ...): the
    name alone was picked by two runs started in the same second, and the second was refused as "--out: ...
    already holds a run", an option it never gave. ``mkdir`` takes a name for one process only."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = make_directory("out", "runs", "directory of runs (the default for a run without --out)")
    n = 1
    while True:
        path = runs / (f"{preset}-{attn}-{stamp}" if n == 1 else f"{preset}-{attn}-{stamp}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
        except OSError as e:
            raise ValueError(f"out: cannot make the run directory {path} ({e.strerror or e}); pass --out") from None


def read_status(out: Path) -> Optional[dict]:
    path = Path(out) / "status.json"
    if not path.is_file():  # a FIFO by that name: read_text waited for a writer forever
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_status(out: Path, status: dict) -> None:
    write_text(Path(out) / "status.json", json.dumps(clean_json(status), indent=1))


class RunLock:
    """``with RunLock(out):`` owns ``out`` for this process, or raises ValueError naming the
    process that does.

    The lock is an exclusive ``flock`` on ``DIR/lock`` (or on the file ``lock`` names: ``qkmla
    convert`` locks ``OUT.lock`` beside an ``OUT`` it makes only at the end): the kernel releases it when its
    process ends, however it ends, so a killed run never leaves a lock that blocks the next
    one, and two processes can never both hold it. The file's text (pid and host) only says
    who holds it.
    """

    def __init__(self, out: Path, lock: Optional[Path] = None):
        self.out = Path(out)
        self.path = Path(lock) if lock is not None else self.out / "lock"  # another file: an out not made yet
        self._fd: Optional[int] = None

    def _owner(self) -> str:
        try:
            owner = json.loads(self.path.read_text())
            return f"process {owner.get('pid')} on {owner.get('host')}"
        except (OSError, ValueError, AttributeError):
            return "another process"

    def _foreign(self) -> bool:
        """A non-empty ``lock`` that is not one of ours ({"pid", "host"}): the user's own file."""
        try:
            if os.path.lexists(self.path) and not self.path.is_file() and not self.path.is_dir():
                return True  # a FIFO or a device: flock refused it with a bare 'Invalid argument'
            if not self.path.is_file() or self.path.stat().st_size == 0:
                return False
            owner = json.loads(self.path.read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            return True
        return not (isinstance(owner, dict) and "pid" in owner)

    def __enter__(self) -> "RunLock":
        import fcntl

        if self._foreign():  # it would be truncated, then removed at the end
            raise ValueError(f"out: {self.path} is not a qkmla lock file, and the run would replace it; "
                             "use another --out")
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
            except OSError as e:  # e.g. a directory named lock, or a read-only directory
                fix = "remove it" if os.path.lexists(self.path) else "write elsewhere"
                raise ValueError(f"out: cannot use the lock file {self.path} ({e.strerror}); {fix}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ValueError(f"out: {self.out} is in use by {self._owner()} (lock file {self.path}); "
                                 "wait for it, or use another --out") from None
            try:  # the holder we waited on may have removed the file: lock the one at the path now
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
        except OSError as e:  # a full disk: os.write's error named no file, and the lock file was left behind
            self.path.unlink(missing_ok=True)  # before unlocking, as __exit__ does
            os.close(fd)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        self.path.unlink(missing_ok=True)  # before unlocking, so no one locks a removed file
        os.close(self._fd)


def remove_stale_lock(path: Path) -> bool:
    """Remove the lock file ``path`` (a :class:`RunLock`'s) if no process holds it: one left by a
    process killed outright, which nothing else would ever remove. True if it was removed."""
    import fcntl

    path = Path(path)
    if RunLock(path.parent, lock=path)._foreign():
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its process is alive
        os.close(fd)
        return False
    try:
        path.unlink(missing_ok=True)  # before unlocking, as RunLock does
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def holds_run(out: Path) -> bool:
    return any((Path(out) / f).exists() for f in RUN_FILES)


def check_run_dir(out: Path, resume: bool, overwrite: bool) -> list[str]:
    """Check what ``out`` holds against what the run wants, reading only; returns the notes for
    the user (a killed previous run). :func:`prepare` does this under the run's lock and then
    clears what the run replaces; training also does it before building the model, so a
    forgotten ``--resume`` is refused at once.

    Raises:
        ValueError: ``out`` holds a run and neither ``resume`` nor ``overwrite`` is set.
    """
    out = Path(out)
    # also refuses an experiment's OUT/runs (only that directory: a folder that merely holds other runs, or a
    # checkpoint, in subfolders is the user's to lay out)
    check_own_directory("out", out, "train")
    notes = []
    for name in RUN_FILES:
        if (out / name).is_dir():
            raise ValueError(f"out: {out / name} is a directory where the run's file goes; "
                             "remove it or use another --out")
        if os.path.lexists(out / name) and not (out / name).is_file():  # a FIFO: a resume read it forever
            raise ValueError(f"out: {out / name} is not a regular file where the run's file goes; "
                             "remove it or use another --out")
        foreign = _not_a_run_file(out / name)
        if foreign:  # someone else's config.json (a transformers checkpoint's, say): never replaced
            raise ValueError(f"out: {out / name} is not a qkmla run's file ({foreign}); --resume and --overwrite "
                             "leave it alone too: use another --out")
    status = read_status(out)
    killed = status is not None and status.get("status") == "running"  # and its lock is free: it died
    if killed:
        what = (f"a run that was killed (pid {status.get('pid')}) after logging step {last_logged_step(out)}, "
                f"with its last checkpoint at step {status.get('checkpoint_step', 0)}")
        notes.append(f"the previous run in {out} was killed (pid {status.get('pid')}, last logged step "
                     f"{last_logged_step(out)}); its last checkpoint is step {status.get('checkpoint_step', 0)}")
    elif status is not None:
        what = f"a run with status {status.get('status')!r} at step {status.get('step')}"
    else:
        what = "the files of a run"
    if holds_run(out) and not (resume or overwrite):
        if not (out / FILENAME).is_file():
            # Stopped before its first checkpoint (killed, or Ctrl-C while it started): --resume, once
            # offered here, then refused it for having no checkpoint to continue from.
            if killed:
                what = f"a run that was killed (pid {status.get('pid')}) after logging step {last_logged_step(out)}"
            # A run that wrote a checkpoint says so in its status; one without any stopped before its first
            # (a done run whose checkpoint was deleted was told that too)
            why = "its checkpoint is gone" if status is not None and status.get("checkpoint_step") else \
                "it stopped before its first"
            raise ValueError(f"out: {out} already holds {what}, with no checkpoint to resume from ({why}); pass "
                             "--overwrite to start it over, or choose a new --out")
        raise ValueError(f"out: {out} already holds {what}; pass --resume to continue it, --overwrite "
                         "to replace it, or choose a new --out")
    return notes


def prepare(out: Path, resume: bool, overwrite: bool) -> Optional[str]:
    """:func:`check_run_dir`, then clear what the run replaces; returns a note for the user (a
    killed previous run, leftovers removed) or None."""
    out = Path(out)
    notes = check_run_dir(out, resume, overwrite)
    if overwrite:
        for name in RUN_FILES:
            (out / name).unlink(missing_ok=True)
    leftovers = sorted(out.glob(FILENAME + ".tmp*"))  # a checkpoint write that was killed
    for p in leftovers:
        p.unlink()
    if leftovers:
        notes.insert(0, f"removed {len(leftovers)} unfinished checkpoint write(s) ({leftovers[0].name})")
    return "; ".join(notes) or None


def _not_a_run_file(path: Path) -> Optional[str]:
    """Why ``path`` (one of RUN_FILES) is not what a qkmla run writes there, or None (it is,
    or it does not exist). Files a killed run may have cut short still count as the run's."""
    if not path.is_file():
        return None
    if path.name == FILENAME:
        from .checkpoint import CheckpointError, read_metadata

        try:
            read_metadata(path)
        except CheckpointError as e:
            return None if "truncated or corrupt" in str(e) else "a safetensors file of another program"
        return None
    if path.name == "metrics.jsonl":  # rows, nothing, or one row cut short by a kill
        # A damaged line that is not UTF-8 among the rows is one line the readers skip (read_rows,
        # plot), not a sign of another program's file: resume refused the whole run over it.
        try:
            text = path.read_bytes().decode("utf-8", "replace")
        except OSError:
            return "not readable"
        lines = [line for line in text.splitlines() if line.strip()]
        if not lines or read_rows(path) or (len(lines) == 1 and lines[0].lstrip().startswith("{")):
            return None
        return "lines that are not metrics rows"
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return "not text"
    try:
        obj = json.loads(text)
    except ValueError:
        return None  # a write cut short by a kill; status and config are rewritten whole
    key = {"config.json": "train", "status.json": "status"}[path.name]
    return None if isinstance(obj, dict) and key in obj else f"a JSON file without the {key!r} a run writes"


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


# The per-step numbers the readers draw, sum and compare (plot, an experiment's results): each a number
# or null in a row the trainer writes. A hand-damaged value ("loss": {"a": 1}, "x") was drawn: a string
# as a category on a loss axis (a wrong figure, without a word), a dict as matplotlib's TypeError.
ROW_NUMBERS = ("loss", "val_loss", "max_logit", "grad_norm", "lr", "step_seconds", "max_logit_after_clip",
               "clipped_heads")


# The largest finite float32: the trainer logs float32 values (a diverged one as NaN or inf), so a finite value past
# it is damage; `qkmla plot` of losses of +-1e308 failed in matplotlib's ticks ("arange: cannot compute length")
FLOAT32_MAX = 3.4028234663852886e38


def _is_row(row) -> bool:
    """A metrics row: a JSON object whose step is an int from 1 to 2**63 - 1 (the trainer's count; a
    damaged step of 10**23 or -5 was drawn as one), and whose :data:`ROW_NUMBERS` are numbers or null,
    NaN, inf or within float32's finite range."""
    if not isinstance(row, dict) or not is_int(step := row.get("step")) or not 1 <= step < 2**63:
        return False
    return all(row.get(k) is None or _is_logged_number(row[k]) for k in ROW_NUMBERS)


def _is_logged_number(v) -> bool:
    """An int or float a float32 could hold, NaN and inf included (an int of 400 digits compared without a float)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    return not (abs(v) > FLOAT32_MAX and (isinstance(v, int) or math.isfinite(v)))


def read_rows(path: Path, skipped: Optional[list] = None) -> list[dict]:
    """The rows of a metrics file; a line that is not a row (a write cut short by a kill,
    or damage) is skipped, and the rows around it kept. ``skipped``, a list, receives the
    1-based number of each line skipped (a reader that shows the rows says which it left out)."""
    rows = []
    if not Path(path).is_file():  # a FIFO by that name: reading it waited for a writer forever
        return rows
    try:
        data = Path(path).read_bytes()
    except OSError:
        return rows
    # Line by line: a damaged line that is not UTF-8 is one line skipped, not the whole file (read
    # as one text, it made every row vanish: `qkmla plot` said the run had logged no step).
    for number, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
            row = json.loads(line)
        except ValueError:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
            line, row = raw.decode("utf-8", "replace"), None
        if _is_row(row):
            rows.append(row)
        elif skipped is not None and line.strip():
            skipped.append(number)
    return rows


def last_logged_step(out: Path) -> int:
    rows = read_rows(Path(out) / "metrics.jsonl")
    return rows[-1]["step"] if rows else 0


def truncate_metrics(out: Path, step: int) -> list[int]:
    """Keep the rows up to ``step`` (a resumed run logs the later ones again), dropping lines
    that are not rows. Returns the steps from 1 to ``step`` that no kept row logs: a run logs
    every step, so these are rows deleted or cut since it wrote them (the caller says so)."""
    path = Path(out) / "metrics.jsonl"
    kept = [r for r in read_rows(path) if r.get("step", 0) <= step]
    write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    logged = {r["step"] for r in kept}
    return [s for s in range(1, step + 1) if s not in logged]


def _steps_text(missing: list[int]) -> str:
    """Sorted steps as ranges, "1-480, 500" rather than 481 numbers (at most four ranges named)."""
    ranges: list[tuple[int, int]] = []
    for s in missing:
        if ranges and s == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], s)
        else:
            ranges.append((s, s))
    runs = [f"{a}" if a == b else f"{a}-{b}" for a, b in ranges]
    return ", ".join(runs[:4]) + (f" and {len(runs) - 4} more ranges" if len(runs) > 4 else "")


def gap_line(path: Path, missing: list[int], step: int) -> str:
    """One warning line for the ``missing`` steps of a resumed run's metrics file ``path``."""
    where = _steps_text(missing)
    steps = "step" if len(missing) == 1 else "steps"
    return (f"warning: {path} holds no row for {len(missing)} of the {step} steps before the checkpoint "
            f"({steps} {where}: deleted or cut since the run wrote them); the resumed run logs from step {step + 1} "
            "on, so its log keeps that gap")


_ABSENT = object()
_READ, _UNREADABLE = object(), object()


def read_config_text(path: Path):
    """A run's ``config.json`` as the resume checks see it: its text, None when there is no such
    file, or a marker for one that cannot be read (not UTF-8, a directory, no permission). A resume
    reads it once and hands the text to every check (:func:`foreign_checkpoint`, then
    :func:`record_edits`): each read it again, so a file replaced between the two got two answers,
    the other run's checkpoint taken for agreeing with one text and the edits judged on another."""
    if not Path(path).is_file():
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return _UNREADABLE


def _short(value) -> str:
    text = "absent" if value is _ABSENT else json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def text_digest(text: str) -> str:
    """The sha256 of ``text`` as UTF-8: how a run's status says which config.json it wrote."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# A resumed run's status key for the digest of the config its checkpoint was saved under, until its first checkpoint.
RESUMED_DIGEST = "resumed_config_sha256"


def note_config_written(out: Path, digest: str) -> None:
    """Before a start writes ``out/config.json``: its status keeps the new text's digest and the
    one before (``config_sha256``, ``config_sha256_previous``), so a start killed on either side of
    the write leaves a file its status vouches for. A first start has no status yet, and nothing to
    resume until its "running" status (with the digest) and a checkpoint are written."""
    status = read_status(out)
    if status is not None:
        write_status(out, {**status, "config_sha256": digest, "config_sha256_previous": status.get("config_sha256")})


def checkpoint_digest(recorded: dict) -> str:
    """The digest of the config.json the run that saved a checkpoint wrote (:func:`text_digest`): the
    checkpoint records the same config (``recorded``), which that file holds as indented JSON."""
    return text_digest(json.dumps(recorded, indent=1))


def written_digests(out: Path) -> tuple:
    """The digests of the config.json texts qkmla last wrote in ``out`` (:func:`note_config_written`), and,
    until a resumed run's first checkpoint, that of the config its checkpoint was saved under
    (``RESUMED_DIGEST``, which a start never shifts)."""
    status = read_status(out) or {}
    keys = ("config_sha256", "config_sha256_previous", RESUMED_DIGEST)
    return tuple(d for d in (status.get(k) for k in keys) if d)


def record_edits(path: Path, recorded: dict, now: dict, written: tuple = (), text=_READ) -> list[str]:
    """The settings a user changed in a run's ``config.json`` (``path``) that a resume would
    overwrite: those whose value there differs both from the run's own record (``recorded``: the
    config its checkpoint carries, which the file was written from) and from what the resume
    writes (``now``). A difference from ``now`` alone is the resume's to make (more steps, another
    lr: RESUMABLE), one from ``recorded`` alone was made by a resume killed before its first
    checkpoint; neither loses anything. A file whose digest is among ``written``
    (:func:`written_digests`: the texts qkmla last wrote there) is qkmla's own, whatever it holds:
    a resume killed before its first checkpoint may have written settings that neither the
    checkpoint nor the next resume has. [] when there is no such file or nothing was changed; a
    file that is not a JSON object is one entry. Entries read "train.lr: 0.5 in the file, 0.001
    recorded, 0.002 now" (", ... now" left out where it is the recorded value); the sections ("train",
    "model") compare field by field. ``text``: the file as :func:`read_config_text` read it, for a
    caller that checks it more than once (a resume: :func:`foreign_checkpoint` first)."""
    text = read_config_text(path) if text is _READ else text
    if text is None:
        return []
    if text is _UNREADABLE:
        return ["not readable JSON: damaged or cut short"]
    if text_digest(text) in written:
        return []
    try:
        saved = json.loads(text)
    except ValueError:
        return ["not readable JSON: damaged or cut short"]
    if not isinstance(saved, dict):
        return ["not a JSON object"]

    def compare(key: str, s, r, n) -> list[str]:
        if isinstance(s, dict) and isinstance(r, dict) and isinstance(n, dict) and key in ("train", "model"):
            return [e for k in sorted(set(s) | set(r), key=str)
                    for e in compare(f"{key}.{k}", s.get(k, _ABSENT), r.get(k, _ABSENT), n.get(k, _ABSENT))]
        if s != r and s != n:  # "now" only where it is not the record (resume_edits compares with the record)
            now_part = f", {_short(n)} now" if n != r else ""
            return [f"{key}: {_short(s)} in the file, {_short(r)} recorded{now_part}"]
        return []

    return [e for key in sorted(set(saved) | set(recorded))
            for e in compare(key, saved.get(key, _ABSENT), recorded.get(key, _ABSENT), now.get(key, _ABSENT))]


def resume_edits(out: Path) -> list[str]:
    """The hand edits of ``out``'s config.json that a resume with the run's own settings would
    refuse (:func:`record_edits` against its checkpoint's record, the digest its status keeps
    vouching for qkmla's own writes): for a caller that resumes many runs (the experiment grid) to
    refuse before any work. [] when there is no checkpoint to compare with or it cannot be read
    (the resume itself then says what is wrong)."""
    try:
        recorded = json.loads(read_metadata(Path(out) / FILENAME)["config"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return record_edits(Path(out) / "config.json", recorded, recorded, written_digests(out))


# TrainConfig fields that define the model or data beyond what the model config and the
# data fingerprint record (block size, p, logit scale, overrides are in the model config).
MUST_MATCH = ("preset", "attn", "tokenizer", "split", "optimizer", "muon_adjust_lr")


def foreign_checkpoint(path: Path, recorded: dict, written: tuple = (), text=_READ) -> list[str]:
    """What defines the model or the data where the ``config.json`` qkmla last wrote in a run directory
    (``path``, its digest among ``written``) and the checkpoint beside it (``recorded``: its record)
    disagree: the checkpoint is another run's, copied or restored there. A resume took its settings from
    the checkpoint, so it trained the other run on, rewrote config.json to it and appended its steps to
    the first run's metrics.jsonl, without a word (probe 19). [] for a file qkmla did not write (a hand
    edit: :func:`record_edits`), one that cannot be read, or one that agrees. Entries read
    "attn: checkpoint 'v4', config.json 'mla-qknorm'". ``text``: as for :func:`record_edits`."""
    text = read_config_text(path) if text is _READ else text
    if text is None or text is _UNREADABLE:
        return []
    try:
        if text_digest(text) not in written:
            return []
        saved = json.loads(text)
        # the checkpoint's keys only: a resume by a newer qkmla, killed before its first checkpoint, wrote
        # config.json with fields the older checkpoint does not record
        diffs = resume_mismatches(recorded, saved)
        # The seed drew the weights: a checkpoint of a run that differs from this one in its seed alone was
        # taken for this run's, trained on, and its steps logged after this run's (probe 22). A seed may change
        # on a resume (a grid's branch names its own): until the resume's first checkpoint its status vouches
        # for the checkpoint it resumed (RESUMED_DIGEST), which is then no other run's.
        seeds = recorded["train"].get("seed"), saved["train"].get("seed")
        if seeds[0] != seeds[1] and checkpoint_digest(recorded) not in written:
            diffs.append(f"seed: stored {seeds[0]!r}, now {seeds[1]!r}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return [d.replace(": stored ", ": checkpoint ", 1).replace(", now ", ", config.json ", 1) for d in diffs]


def resume_mismatches(stored: dict, now: dict) -> list[str]:
    """What differs between a stored run (its config.json) and the run now asked for, in
    what defines the model or the data. Both are run configs: {"train", "model",
    "tokenizer", "data"}; the data is compared by content (a file read from another path,
    or by another relative path, is the same data)."""
    st, nt = stored.get("train", {}), now["train"]
    diffs = [f"{k}: stored {st[k]!r}, now {nt[k]!r}" for k in MUST_MATCH if k in st and st[k] != nt[k]]
    named = {d.split(":")[0] for d in diffs}
    diffs += [f"model.{k}: stored {v!r}, now {now['model'].get(k)!r}" for k, v in stored.get("model", {}).items()
              if now["model"].get(k) != v and k not in named]
    if "data" in stored:
        if stored["data"] != now["data"]:
            diffs.append(f"data: the text differs from the stored run's (stored {stored['data']}, now {now['data']} "
                         f"from {nt['data']!r})")
    elif st.get("data") != nt["data"]:  # a run from before fingerprints: compare the names
        diffs.append(f"data: stored {st.get('data')!r}, now {nt['data']!r}")
    if stored.get("tokenizer") not in (None, now["tokenizer"]):
        diffs.append("tokenizer vocabulary: differs from the stored run's")
    return diffs
