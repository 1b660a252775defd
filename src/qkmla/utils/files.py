"""How every qkmla command writes a file: to a temporary name in the same directory, then renamed.

A crash, a kill or a full disk in the middle of a write leaves the file that was there (or
none), never half of a new one: ``os.replace`` within one directory is atomic. The
temporary name is ``NAME.tmpPID``; a failed write, Ctrl-C or SIGTERM removes it, and what a
process killed outright (SIGKILL, a power cut) left is swept by the next write of the same name
(:func:`clear_stale`). Errors are ``OSError``s that name the path (safetensors' own error for a
failed write is turned into one), which the command line reports in one line.

:func:`write_atomically` is the one way the package writes a file: ``durable`` (the default)
also fsyncs the file before the rename and the directory after it, so what a later run reads
(results, statuses, checkpoints) survives a crash of the machine too, not only of the process.
:func:`write_directory` writes a directory (a converted checkpoint) the same way.
:func:`check_output` refuses, before any work, an output that is an input of the command, or
exists, unless ``--overwrite`` says to replace it (an existing file in another command's directory,
a run's checkpoint say, whatever it says; ``qkmla experiment`` also refuses another
experiment's results: ``experiments.base``); :func:`check_own_directory` refuses a directory
that holds another command's output (a training run, a demo, an experiment's results, a
transformers checkpoint) to a command that writes a directory of its own; :func:`check_path` and
:func:`check_writable` refuse paths the OS cannot use, naming the option; :func:`make_directory` makes
an output's directory or says, naming the option, what is in the way; :func:`check_input_file`
refuses an input that is not a regular file, saying what it is.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

PathLike = Union[str, Path]


def temporary_name(path: PathLike) -> Path:
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


_STALE = re.compile(r"\.(tmp|replaced)(\d+)$")


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user's counts: it may still be writing)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def clear_stale(path: PathLike) -> list[Path]:
    """What writes of ``path`` by processes that no longer run left beside it (killed outright:
    no ``finally`` ran): temporaries ``NAME.tmpPID`` are removed, and an existing ``path`` that a
    killed :func:`write_directory` had moved aside (``NAME.replacedPID``) is put back if ``path``
    is missing. A live process's temporaries (another instance writing now) are left alone.
    Returns the paths removed or put back."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    try:
        names = [e.name for e in os.scandir(parent) if e.name.startswith(path.name + ".")]
    except OSError:  # no such directory yet: nothing was left in it
        return []
    cleared = []
    for name in sorted(names):
        m = _STALE.fullmatch(name[len(path.name):])
        if m is None or _running(int(m.group(2))):
            continue
        stale = parent / name
        if m.group(1) == "replaced" and not os.path.lexists(path):
            os.replace(stale, path)  # the old output, moved aside by a write killed before its new one was in place
        elif stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
        cleared.append(stale)
    return cleared


@contextmanager
def signals_held(second_acts: bool = False):
    """SIGINT, SIGTERM and SIGHUP that arrive inside are acted on when it ends, each once, in the order they
    first came, by the handlers in force before it: renames that must not be cut in half, and the removal of a
    temporary, finish first. ``second_acts``: a second Ctrl-C is acted on at once, after the ones
    held (for work that could hang: a second Ctrl-C is never ignored). Not a second SIGTERM: those
    come in pairs without anyone asking twice (a kill of the process group and of the pid, a
    launcher forwarding its own), and SIGKILL is there for a stuck process. In threads other than
    the main one (where Python runs no handler) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {}

    def restore():
        # emptied before re-installing: signal.signal runs pending handlers, which may come back here
        items = list(previous.items())
        previous.clear()
        for s, handler in items:
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)

    def hold(signum, frame):
        if second_acts and signum == signal.SIGINT and signum in caught and previous:
            pending = list(dict.fromkeys(caught)) + [signum]  # the first Ctrl-C, then this one
            caught.clear()
            restore()  # what comes after is acted on where it lands
            for s in pending:
                signal.raise_signal(s)
            return
        caught.append(signum)

    try:
        # inside the try: a signal between them is restored too. SIGHUP as SIGTERM (errors.TERMINATING_SIGNALS): a
        # closed terminal must not cut a rename in half either. One the process ignores stays ignored.
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if s == signal.SIGINT or signal.getsignal(s) is not signal.SIG_IGN:
                previous[s] = signal.signal(s, hold)
        yield
    finally:
        restore()
        pending = list(dict.fromkeys(caught))
        caught.clear()
        for s in pending:
            signal.raise_signal(s)


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (``/proc/self/status``):
    setting it to read it back would, for that instant, give another thread's new files mode 0666."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _give_mode(written: Path, old: Optional[Path] = None, default: int = 0o666) -> None:
    """``written`` gets the mode of what it replaces (``old``, not followed if a link), or the mode
    a new one gets under the umask (0644 for a file under the usual 022; ``default`` 0o777 for a
    directory). safetensors writes through a private temporary (mode 0600), so a checkpoint or a
    converted model was readable by its owner alone: on a shared machine, a colleague (or a serving
    job under another user) could not load it. Best effort: a file system without modes (vfat,
    some network mounts) refuses chmod, and the write stands."""
    mode = None
    if old is not None:
        try:
            st = os.lstat(old)
            mode = None if stat.S_ISLNK(st.st_mode) else stat.S_IMODE(st.st_mode)
        except OSError:
            pass
    try:
        os.chmod(written, default & ~_umask() if mode is None else mode)
    except OSError:
        pass


def _fsync(path: Path, directory: bool = False) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    except OSError:
        if directory:  # some file systems cannot open a directory: the rename itself still happened
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def write_atomically(path: PathLike, write: Callable[[Path], None], durable: bool = True) -> Path:
    """``write(tmp)`` writes the file at a temporary path beside ``path``, which then replaces
    ``path`` in one rename. On any failure the temporary file is removed and ``path`` is
    untouched. ``durable``: fsync the file before the rename and its directory after. A symbolic
    link named ``path`` is replaced, never followed: a file of a run, a figure, a results file
    lands where its command checked it may (a link could lead into another run, past its lock)."""
    path = Path(path)
    tmp = temporary_name(path)
    clear_stale(path)
    try:
        write(tmp)
        _give_mode(tmp, path)
        if durable:
            _fsync(tmp)
        os.replace(tmp, path)
        if durable:
            _fsync(path.parent if str(path.parent) else Path("."), directory=True)
    except BaseException as e:
        with signals_held():
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        # The user named path, not tmp; a failed flush at close names no file at all.
        if isinstance(e, OSError) and e.filename in (str(tmp), tmp, None):
            raise OSError(e.errno, e.strerror or str(e), str(path)) from None
        raise
    return path


def directory_state(path: PathLike) -> Optional[tuple]:
    """What is at ``path`` now, to tell later whether another process wrote there meanwhile: None
    if nothing is; else its device, inode and modification time (a file made or removed in a
    directory changes the directory's) and, for a directory, the names in it."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    names = ()
    if stat.S_ISDIR(st.st_mode):
        try:
            names = tuple(sorted(os.listdir(path)))
        except OSError:
            pass
    return st.st_dev, st.st_ino, st.st_mtime_ns, names


UNCHECKED = object()  # write_directory without a state to compare: whatever is at out is replaced


def write_directory(out: PathLike, write: Callable[[Path], None], unchanged_from=UNCHECKED, name: str = "out") -> Path:
    """``write(tmp)`` fills a directory under the temporary name ``OUT.tmpPID`` beside ``out``,
    renamed ``out`` when complete; an existing ``out`` is moved aside (``OUT.replacedPID``) only
    once the new one is complete and removed after the rename. A failure, Ctrl-C or SIGTERM
    removes the temporary and leaves ``out`` as it was; the two renames and the clean-up finish
    before a signal is acted on (:func:`signals_held`). What a process killed outright left is
    swept by the next write of ``out`` (:func:`clear_stale`: the temporary removed, an ``out``
    moved aside put back). A full disk (inside safetensors or transformers too) is one OSError
    naming ``out``. A symbolic link named ``out`` is replaced as a name (a command that writes
    where a link points resolves it first, once: :func:`output_directory`). The new directory and
    its files keep the modes of those they replace; new ones get the umask's (:func:`_give_mode`).
    ``unchanged_from``: what :func:`directory_state` said of ``out`` when the command checked it may
    write there; if ``out`` is no longer that at the rename (another command made or wrote it since:
    ``qkmla train --out`` the same directory during a conversion), nothing is replaced and a
    ValueError naming ``out`` (as option or argument ``name``) says so: the rename moved the other
    command's output aside and deleted it, a training run lost without --overwrite."""
    out = Path(out)
    tmp = temporary_name(out)
    clear_stale(out)
    try:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            write(tmp)
            for written in tmp.rglob("*"):  # transformers' files too, through safetensors: see _give_mode
                if written.is_file() and not written.is_symlink():
                    _give_mode(written, out / written.relative_to(tmp))
            _give_mode(tmp, out, default=0o777)
        except Exception as e:  # a full disk inside safetensors or transformers: one line naming out
            error = as_os_error(e, out)
            if error is None:
                raise
            raise error from None
        with signals_held():
            if unchanged_from is not UNCHECKED and directory_state(out) != unchanged_from:
                now = "now holds " + describe_directory(out) if os.path.lexists(out) else "was removed"
                raise ValueError(f"{name}: {out} changed while this command worked (it {now}: another command wrote "
                                 "there); it was left as it is and this output was not written; run again to "
                                 "check it anew")
            if os.path.lexists(out):
                old = out.with_name(f"{out.name}.replaced{os.getpid()}")
                out.replace(old)
                tmp.replace(out)
                if old.is_symlink() or not old.is_dir():
                    old.unlink(missing_ok=True)
                else:
                    shutil.rmtree(old, ignore_errors=True)
            else:
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp.replace(out)
    finally:
        with signals_held():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def describe_directory(path: PathLike) -> str:
    """What ``path`` holds, for a message: "a qkmla training run (status.json, ...)" or "3 entries"."""
    kind = directory_kind(path)
    if kind is not None:
        return kind[1]
    try:
        return f"{len(os.listdir(path))} entries" if Path(path).is_dir() else "a file"
    except OSError:
        return "something it cannot list"


def output_directory(name: str, out: PathLike) -> Path:
    """Where a command that writes a directory of its own (``convert``, ``convert-gqa``) writes
    ``out``: the directory a symbolic link of this user's points to (``ln -s /scratch/models/x out``:
    a bigger disk), or ``out`` itself. Resolved once, before the checks and the lock, so a link
    changed during the work cannot send the write elsewhere. ValueError naming option ``name`` for
    a link that leads nowhere (the rename at the end failed on it, after all the work), or another
    user's link (not followed, as the kernel's protected_symlinks refuses in a shared directory
    such as /tmp, nor replaced)."""
    out = Path(out)
    try:
        link = out.is_symlink()
    except OSError as e:  # a name too long: lstat's bare OSError reached convert_checkpoint's caller, naming no option
        raise ValueError(f"{name}: cannot use the directory {out} ({e.strerror}); write elsewhere") from None
    if not link:
        return out
    problem = link_problem(out)
    if problem is not None:
        raise ValueError(f"{name}: {out} {problem}; make that directory, or write elsewhere")
    if os.lstat(out).st_uid != os.geteuid():
        raise ValueError(f"{name}: {out} is a symbolic link of another user, which qkmla does not follow (nor "
                         "replace); write elsewhere")
    return Path(os.path.realpath(out))


def link_problem(path: PathLike) -> Optional[str]:
    """Why the symbolic link ``path`` leads nowhere, as the end of a sentence naming it, or None (not
    a link, or a link to something): "is a symbolic link to X, which does not exist", "... which
    leads to nothing" (a chain of links), "is a symbolic link in a loop of links"."""
    import errno

    path = Path(path)
    try:
        if not path.is_symlink():
            return None
    except OSError:  # a name too long: not a link problem, the caller's own lookup says what
        return None
    try:
        target = os.readlink(path)
        os.stat(path)
        return None
    except FileNotFoundError:
        end = "leads to nothing" if os.path.lexists(path.parent / target) else "does not exist"
        return f"is a symbolic link to {target}, which {end}"
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link in a loop of links"
        return f"is a symbolic link that cannot be followed ({e.strerror})"


def write_text(path: PathLike, text: str, durable: bool = True) -> Path:
    return write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable)


def write_bytes(path: PathLike, data: bytes, durable: bool = True) -> Path:
    return write_atomically(path, lambda tmp: tmp.write_bytes(data), durable)


def append_line(path: PathLike, line: str) -> None:
    """Append one line to a log (``metrics.jsonl``) and flush it. The one write that is not a
    rename: a log grows row by row, and a row cut short by a kill is skipped by its reader. A
    failed append (a full disk) is cut back to the rows before it and raised naming ``path``."""
    path = Path(path)
    data = line.encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        except OSError as e:
            try:
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise OSError(e.errno, f"{e.strerror} (appending a row to the log; the rows before it are kept)",
                          str(path)) from None
    finally:
        os.close(fd)


def check_path(name: str, path: PathLike, what: str = "path") -> Path:
    """ValueError naming option ``name`` for a path the OS cannot look up at all (a name too long,
    a file where a directory is needed, a symlink loop) or an empty one, before any work; returns
    it as a Path.
    A path that does not exist yet is fine."""
    if isinstance(path, (str, bytes)) and len(path) == 0:  # Path("") is ".": the working directory, unasked for
        raise ValueError(f"{name}: expected the path of the {what}, got an empty string")
    path = Path(path)
    try:
        os.stat(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ValueError(f"{name}: cannot use the {what} {path} ({e.strerror})") from None
    return path


def input_file_problem(path: PathLike) -> Optional[str]:
    """Why ``path`` cannot be read as a file, as the end of a sentence naming it, or None (a
    regular file, or a link to one): "does not exist", "is a symbolic link to X, which does not
    exist", "is a directory", "is not a regular file (a FIFO)" (or what else it is: :func:`not_a_regular_file`).
    A FIFO read as a file waits for a writer forever, /dev/zero never ends: both are refused by what they are."""
    if isinstance(path, (str, bytes)) and len(path) == 0:  # Path("") is ".", a directory
        return "is an empty path"
    path = Path(path)
    link = link_problem(path)
    if link is not None:
        return link
    try:
        if path.is_file():
            return None
        kind = not_a_regular_file(path)
    except OSError as e:  # a name too long, a loop of links
        return f"cannot be looked up ({e.strerror})"
    if kind is None:
        return "does not exist"
    return "is a directory" if kind == "a directory" else f"is not a regular file ({kind})"


def not_a_regular_file(path: PathLike) -> Optional[str]:
    """What ``path`` is when it exists but is no regular file (nor a link to one): "a directory", "a FIFO",
    "a character device", "a block device", "a socket" or "a symbolic link to nothing"; None when it is
    one or is absent. Reading a FIFO waits for a writer for good: a caller refuses it by what it is."""
    path = Path(path)
    if not os.path.lexists(path) or path.is_file():
        return None
    if path.is_dir():
        return "a directory"
    return special_file(path) or ("a symbolic link to nothing" if not path.exists() else None)


def check_input_file(name: str, path: PathLike, what: str = "file") -> Path:
    """``path`` as a Path if it is a regular file (or a link to one), else a ValueError naming option
    ``name``: "--sweep: the results file runs/x.jsonl does not exist"."""
    problem = input_file_problem(path)
    if problem is not None:
        raise ValueError(f"{name}: the {what} {path} {problem}")
    return Path(path)


def make_directory(name: str, path: PathLike, what: str = "directory") -> Path:
    """``mkdir -p path``, or a ValueError naming option ``name`` and why it cannot be made: a
    symbolic link to nothing on the way (the OS says only "File exists"), a file in the way, no
    permission, a read-only file system, a name too long. Returns ``path`` as a Path."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{name}: cannot make the {what} {path} ({_why_not_a_directory(path, e)})") from None
    return path


def _why_not_a_directory(path: Path, error: OSError) -> str:
    """The reason :func:`make_directory` failed, naming the part of ``path`` in the way."""
    import errno

    if error.errno in (errno.EEXIST, errno.ENOTDIR, errno.ELOOP):
        for part in (path, *path.parents):
            try:
                link = link_problem(part)
                if link is not None:
                    return f"{part} {link}"
                if part.exists() and not part.is_dir():
                    return f"{part} is a file, not a directory"
            except OSError:  # a part the OS cannot look up: its own error says why
                break
    return error.strerror or str(error)


# What each kind of output directory holds at its top, by the command that writes it. A command
# that writes a directory of its own (train, demo, experiment) never writes into another's,
# whatever --overwrite says: --overwrite replaces the command's own files, and those of the other
# would be left mixed with them. (convert and convert-gqa refuse any directory that is not a
# transformers checkpoint themselves.)
DIRECTORY_KINDS = {
    "train": ("a qkmla training run", ("status.json", "checkpoint.safetensors", "metrics.jsonl")),
    "demo": ("a qkmla demo", ("demo.json",)),
    "experiment": ("an experiment's results", ("summary.json", "results.jsonl")),
    "convert": ("a transformers checkpoint", ("model.safetensors", "model.safetensors.index.json",
                                             "pytorch_model.bin")),
}
# The kinds whose command draws its own figures at the directory's top, by name: the demo's
# curves.png; an experiment's report figures, which its summary.json lists under "figures" (None
# here). plot --overwrite must not replace one (the demo's or the experiment's report would show
# plot's curves under its own name); any other figure there is one plot drew, and is replaced as
# in a training run, which draws none.
DRAWS_FIGURES = {"demo": ("curves.png",), "experiment": None}


def drawn_by(directory_owner: str, figure: Path) -> bool:
    """Whether ``figure`` is one the command owning its directory draws (:data:`DRAWS_FIGURES`). An
    experiment's summary.json that does not list its figures (written before it did, or not yet
    written) counts every figure there as the experiment's."""
    if directory_owner not in DRAWS_FIGURES:
        return False
    names = DRAWS_FIGURES[directory_owner]
    if names is None:
        summary = figure.parent / "summary.json"
        try:  # only a regular file of a summary's size is read (a FIFO there would block plot)
            if not summary.is_file() or summary.stat().st_size > 2**20:
                return True
            names = json.loads(summary.read_text(encoding="utf-8"))["figures"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            return True
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return True  # not a list of names (edited by hand): every figure counts as the experiment's
    return figure.name in names


def check_own_directory(name: str, out: PathLike, command: str) -> None:
    """Before any work: ValueError naming option ``name`` if the directory ``out`` holds another
    command's output (:data:`DIRECTORY_KINDS`) that ``command`` would write beside."""
    out = Path(out)
    # An experiment's OUT/runs is its grid's: what is written there, beside the grid's runs, is nothing the
    # experiment planned, in the place its runs are looked up. train refused it; demo trained its four runs
    # there, and an experiment its results, figures and a runs/ of its own, without a word.
    kind = directory_kind(out.parent) if out.name == "runs" else None
    if kind is not None and kind[0] == "experiment":
        own = "a run goes in a directory of its own" if command == "train" else \
            f"qkmla {command} writes in a directory of its own"
        raise ValueError(f"{name}: {out} is where the experiment in {out.parent} trains its runs (qkmla experiment's "
                         f"own directory); {own}: choose a new --out")
    if not out.is_dir():
        return
    for owner, (what, files) in DIRECTORY_KINDS.items():
        found = [f for f in files if (out / f).exists()] if owner != command else []
        if found:
            raise ValueError(f"{name}: {out} holds {what} ({', '.join(found)}); qkmla {command} does not write "
                             f"into another command's directory (--overwrite replaces only its own files); write "
                             "elsewhere")


def directory_kind(directory: PathLike) -> Optional[tuple[str, str]]:
    """(command, what) of the output of another command that ``directory`` holds
    (:data:`DIRECTORY_KINDS`: a training run, a demo, an experiment's results, a transformers
    checkpoint), or None."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    for owner, (what, files) in DIRECTORY_KINDS.items():
        if any((directory / f).exists() for f in files):
            return owner, what
    return None


def check_writable(name: str, directory: PathLike) -> None:
    """ValueError naming ``name`` if files cannot be made in the existing ``directory`` (read-only,
    no permission), found by making one, before any work."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".qkmla-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{name}: cannot write in {directory} ({e.strerror}); use another {name}") from None


def save_safetensors(tensors: dict, path: PathLike, metadata: Optional[dict] = None) -> Path:
    """``safetensors.torch.save_file``, atomically, with an I/O failure (a full disk, a file size
    limit, no permission) raised as the ``OSError`` it is, naming ``path``."""
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except Exception as e:
            error = as_os_error(e, path)
            if error is None:
                raise
            raise error from None

    return write_atomically(path, write)


def as_os_error(e: BaseException, path: PathLike) -> Optional[OSError]:
    """An I/O failure reported by a library in its own exception (safetensors' SafetensorError
    "... os error 28", a wrapped OSError) as the ``OSError`` it is, naming ``path``; None if
    ``e`` is not one."""
    if isinstance(e, OSError):
        return OSError(e.errno, e.strerror or str(e), str(path))
    code = re.search(r"os error (\d+)", str(e))
    if code is None:
        cause = e.__cause__ or e.__context__
        return as_os_error(cause, path) if cause is not None and cause is not e else None
    return OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path))


def same_file(a: PathLike, b: PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def special_file(path: PathLike) -> Optional[str]:
    """What ``path`` (or the file a link there points to) is when it exists and is neither a regular file nor a
    directory: "a FIFO", "a character device" (/dev/null), "a block device" or "a socket"; else None."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # missing, a link to nothing, a name the OS refuses: not one of these
        return None
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def check_output(name: str, outputs: Iterable[PathLike], inputs: Iterable[PathLike], overwrite: bool,
                 what: str = "output", own_suffixes: tuple = ()) -> None:
    """Before any work: ValueError naming option ``name`` if an output file is one of the inputs
    (whatever ``overwrite`` says), is a directory, is an existing file in another command's directory
    (:func:`directory_kind`) other than one of the kind this command writes (``own_suffixes``, when
    given: a figure drawn there before), or one of that kind where the other command draws its own
    (:func:`drawn_by`), whatever ``overwrite`` says, or already exists without ``overwrite``; or if its
    directory exists but takes no new file (:func:`check_writable`)."""
    inputs = [Path(p) for p in inputs]
    existing = []
    for out in map(Path, outputs):
        clash = next((p for p in inputs if out == p or same_file(out, p)), None)
        if clash is not None:
            raise ValueError(f"{name}: {out} is an input of this command ({clash}); writing it would destroy "
                             f"what is being read, so write elsewhere")
        if out.is_dir():
            raise ValueError(f"{name}: cannot write the {what} file {out}, which is a directory; write elsewhere")
        special = special_file(out)
        if special is not None:  # the write renames a new file over the name: a FIFO or /dev/null was removed
            raise ValueError(f"{name}: {out} is {special}, not a regular file; the {what} is written to a temporary "
                             f"file renamed over its name, which would replace it (--overwrite too): give a regular "
                             f"file's name")
        # A file in another command's directory (a run's checkpoint or status, an experiment's results)
        # is that command's output: --overwrite replaced it with this one (a run that no longer loads).
        # Only for a command that says which files are its own (a benchmark writing its result beside
        # an experiment's files in benchmarks/results/ is not writing over them).
        # A new file counts too: one the other command's readers take by its name (a figure saved as
        # model.safetensors beside a sharded checkpoint's index is what transformers then loads) is no
        # less a change to that directory's output than a replaced one.
        kind = directory_kind(out.parent) if own_suffixes else None
        if kind is not None and out.suffix.lower() not in own_suffixes:
            being = "is a file" if os.path.lexists(out) else "would be a new file"
            raise ValueError(f"{name}: {out} {being} of {kind[1]} (qkmla {kind[0]}'s output in {out.parent}); "
                             f"this command writes only its own {what} files there ({', '.join(own_suffixes)}), "
                             "never another command's; write elsewhere")
        if kind is not None and os.path.lexists(out) and drawn_by(kind[0], out):  # replacing its figure
            raise ValueError(f"{name}: {out} is a {what} of {kind[1]} (qkmla {kind[0]} draws its own {what}s in "
                             f"{out.parent}); --overwrite never replaces another command's {what}; write elsewhere")
        if os.path.lexists(out):  # a link to nothing too: the user's own, replaced by the file without a word
            existing.append(str(out))
    if existing and not overwrite:
        raise ValueError(f"{name}: {', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; pass "
                         f"--overwrite to replace {'it' if len(existing) == 1 else 'them'}, or write elsewhere")
    # A directory that exists but takes no new file (read-only, another user's) is the argument's
    # problem, found before the work as a missing one is (make_directory): it was found only by the
    # write at the end, a bare "Permission denied" after the work.
    for directory in dict.fromkeys(Path(out).parent for out in outputs):
        if directory.is_dir():
            check_writable(name, directory)
