"""How every qkmla command reports a refused argument: one line, ``qkmla COMMAND: ARGUMENT:
message``, exit status 2. Kept free of heavy imports so any command can use it."""

from __future__ import annotations

import argparse
import re
import unicodedata
from contextlib import contextmanager


class Parser(argparse.ArgumentParser):
    """argparse with qkmla's error format (``--help`` still shows the usage)."""

    def error(self, message: str):
        m = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message, flags=re.S)
        if m:
            message = f"{m.group(1)}: {m.group(2)}"
        self.exit(2, f"{self.prog}: {one_line(message)}\n")


def flag_message(message: str, fields) -> str:
    """An error naming a field as the option that sets it: 'grad_clip: ...' -> '--grad-clip: ...'
    (``fields``: the names that are options of the command)."""
    m = re.match(r"(\w+): ", message)
    if m and m.group(1) in set(fields):
        return f"--{m.group(1).replace('_', '-')}: " + message[m.end():]
    return message


def one_line(text: str) -> str:
    """``text`` with its control characters escaped as Python writes them in a string (a newline as ``\\n``, an
    escape as ``\\x1b``): a path holding a newline split a refusal naming it in two lines (the second read as
    a message of its own), and a carriage return or an escape sequence in a name rewrote the terminal's line."""
    if text.isprintable():
        return text
    return "".join(_ESCAPES.get(c, f"\\x{ord(c):02x}") if unicodedata.category(c) == "Cc" else c for c in text)


_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


class MachineError(RuntimeError):
    """An error of the machine or of the launch rather than of qkmla or of the user's arguments
    (under torchrun: a rank that never joined, a collective that waited past --dist-timeout):
    its message is the one line the command prints, exit status 1."""


def environment_message(e: BaseException):
    """One line for an error of the machine rather than of qkmla (a full disk, a read-only or
    missing file, no permission, memory run out, a :class:`MachineError`), naming the path; None
    for anything else."""
    if isinstance(e, MachineError):
        return str(e)
    if isinstance(e, OSError):
        cause = _unusable_tempdir(e)
        if cause:
            return cause
        where = f"{e.filename}: " if getattr(e, "filename", None) else _full_stdout(e)
        also = f" -> {e.filename2}" if getattr(e, "filename2", None) else ""
        return f"{where}{e.strerror or e}{also}"
    if isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and (
            "can't allocate memory" in str(e) or type(e).__name__ == "OutOfMemoryError")):
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"out of memory ({first[:200]}); use smaller sizes or free memory"
    return None


def _unusable_tempdir(e: OSError):
    """The cause behind tempfile's "No usable temporary directory found in [...]" (torch's import asks for the
    temporary directory, and tempfile tries a write in each candidate), which keeps no errno of the writes it
    tried: under ``ulimit -f 0`` or a full /tmp, ``qkmla train`` said only that, naming neither the limit nor
    the disk. One line naming the first candidate and why a file cannot be written there; None for any other
    error, or where the write now succeeds."""
    import os
    import tempfile

    if not (isinstance(e, FileNotFoundError) and str(e.args[-1] if e.args else "").startswith(
            "No usable temporary directory")):
        return None
    # tempfile's own list (private, in every Python from 3.10 to 3.13); else the one its message prints
    candidates = getattr(tempfile, "_candidate_tempdir_list", None)
    if candidates is not None:
        candidates = candidates()
    else:
        import ast

        try:
            candidates = [str(c) for c in ast.literal_eval(str(e.args[-1]).partition(" found in ")[2])]
        except (ValueError, SyntaxError, TypeError):
            return None
    for directory in candidates:
        if not os.path.isdir(directory):
            continue
        path = os.path.join(directory, f".qkmla-probe-{os.getpid()}")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, b"x")  # tempfile writes a few bytes: a file-size limit of 0 refuses even one
            finally:
                os.close(fd)
                os.unlink(path)
        except OSError as err:
            return (f"{directory}: cannot write a temporary file there ({err.strerror or err}); torch needs one as "
                    "it loads: free space, raise the file-size limit (ulimit -f), or set TMPDIR to a writable "
                    "directory")
    return None


def _full_stdout(e: OSError) -> str:
    """``"stdout (PATH): "`` for a full disk or file-size limit met without a file name: every file qkmla writes
    is named in its error (``utils.files``), so this is the command's printed output (``qkmla verify --json > out``
    under ``ulimit -f``, or ``> /dev/full``), which said "File too large" and no more. "" otherwise."""
    import errno
    import os
    import sys

    if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        return ""
    try:
        target = os.readlink(f"/proc/self/fd/{sys.stdout.fileno()}")  # Linux: where stdout goes
    except (OSError, ValueError, AttributeError):
        target = None
    return f"stdout ({target}): " if target else "stdout: "


def quiet_broken_pipe() -> None:
    """The reader of stdout went away (``qkmla ... | head``): stop without a traceback, and keep
    Python's own flush at exit from failing on the closed pipe."""
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def notice(text: str, stream=None) -> None:
    """Print ``text`` from a signal handler. Its reader may be gone (``qkmla ... 2>&1 | tee log``: the
    same Ctrl-C ends tee): the BrokenPipeError, raised inside the handler, skipped the rest of it (the
    request never passed on to the runs in flight, or a training step cut off), so a closed stream
    loses the line, never the handling."""
    import sys

    stream = sys.stderr if stream is None else stream
    try:
        print(text, file=stream, flush=True)
    except (OSError, ValueError, RuntimeError):  # a closed pipe, a closed file, a write the signal interrupted
        pass


class Stopped(Exception):
    """A command stopped on request (a signal), cleanly: ``message`` is its one line and
    ``exit_code`` its status (128 + the signal's number, as a shell reports)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# The signals that ask a command from outside to stop, each handled as SIGTERM is: SIGTERM (``kill``,
# Slurm, Kubernetes, ``docker stop``) and SIGHUP (the terminal or ssh session that started it closed,
# ``kill -HUP``). Python leaves SIGHUP at its default, which ended the process on the spot: a training
# run lost the steps since its last checkpoint and kept status "running" and its lock (probe 18).
TERMINATING_SIGNALS = ("SIGTERM", "SIGHUP")


class Terminated(BaseException):
    """SIGTERM or SIGHUP (:data:`TERMINATING_SIGNALS`) to a command that has no handling of its own
    (``train`` and ``experiment`` checkpoint instead): it unwinds the command as Ctrl-C does, so every
    ``finally`` and every write's clean-up runs (a half-written temporary is removed), where Python's
    default would end the process on the spot. Not an ``Exception``: no ``except Exception`` takes it
    for an error of the work. Its argument is the signal's name."""

    @property
    def exit_code(self) -> int:
        import signal

        return 128 + getattr(signal, str(self.args[0]) if self.args else "SIGTERM", signal.SIGTERM)


@contextmanager
def sigterm_unwinds():
    """``with sigterm_unwinds():`` SIGTERM and SIGHUP (:data:`TERMINATING_SIGNALS`) raise
    :class:`Terminated` in the main thread (elsewhere, where Python runs no handler, nothing is
    installed); the previous handlers come back after. One its starter ignores (``nohup``'s SIGHUP,
    ``trap '' TERM``) stays ignored."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def unwind(signum, frame):
        raise Terminated(signal.Signals(signum).name)

    previous = {}
    try:
        for name in TERMINATING_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, unwind)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
