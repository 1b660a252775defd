"""Exceptions from signal handlers raised only where Python code can take them: not inside an import.

Python runs a signal's handler at the next bytecode of the main thread, wherever that is. Inside an
import it can be Python code that a C extension's initializer called (triton's libtriton, built with
nanobind, builds Python enums as transformers and torch._dynamo import it): an exception there
cannot pass back through the C++ frames, and the process aborts ("terminate called after throwing an
instance of 'nanobind::python_error'", exit 134, a hundred lines of traceback) where a SIGTERM or
Ctrl-C should end the command in one line. So a handler that would raise inside an import defers
instead: a watcher thread sends the same signal to the main thread again once it has left every
import (imports take seconds), and the handler in force then acts on it. An import still running
after :data:`GRACE_S` is taken as stuck, and the signal is acted on inside it (better an abort than
a command deaf to SIGTERM).
"""

from __future__ import annotations

import signal
import sys
import threading
import time

GRACE_S = 30.0
_POLL_S = 0.02
_pending: set = set()  # signals a watcher will send again
_forced: set = set()  # signals whose import outlived GRACE_S: acted on wherever they land
_lock = threading.Lock()


def in_import(frame) -> bool:
    """Whether ``frame`` (a frame of the main thread) runs inside an import."""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<frozen importlib._bootstrap") or name.endswith(
                ("importlib/_bootstrap.py", "importlib/_bootstrap_external.py")):
            return True
        frame = frame.f_back
    return False


def deferred(signum: int, frame) -> bool:
    """True if the signal ``signum``, whose handler runs at ``frame``, is deferred (the handler
    returns without acting: the signal comes again once the import is over); False if the handler
    may act (and raise) now."""
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        if signum in _forced:
            _forced.discard(signum)
            return False
        if not in_import(frame):
            return False
        if signum in _pending:  # a second one while the first waits: one delivery says it
            return True
        _pending.add(signum)
    threading.Thread(target=_send_again, args=(signum, threading.main_thread().ident), daemon=True,
                     name=f"qkmla-deferred-{signal.Signals(signum).name}").start()
    return True


def raise_when_safe(signum: int, frame, error: BaseException) -> None:
    """``raise error`` from a signal handler, unless the signal is :func:`deferred`."""
    if not deferred(signum, frame):
        raise error


def interrupt(signum, frame) -> None:
    """SIGINT as Python's own handler (KeyboardInterrupt), deferred out of imports."""
    raise_when_safe(signum, frame, KeyboardInterrupt())


def _send_again(signum: int, ident: int) -> None:
    deadline = time.monotonic() + GRACE_S
    while True:
        time.sleep(_POLL_S)
        frame = sys._current_frames().get(ident)
        if frame is None:  # the main thread is gone
            return
        if not in_import(frame):
            break
        if time.monotonic() > deadline:
            with _lock:
                _forced.add(signum)
            break
        del frame
    with _lock:
        _pending.discard(signum)
    try:
        signal.pthread_kill(ident, signum)
    except (OSError, ValueError, ProcessLookupError):
        pass
