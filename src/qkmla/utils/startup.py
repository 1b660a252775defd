"""Ctrl-C or SIGTERM while qkmla's command line starts: one line and exit 130 or 143.

``python -m qkmla COMMAND`` (and the ``qkmla`` script, ``python -m qkmla.train``) spends its first
seconds importing torch and building the parser, before ``main()`` reaches the ``try`` that turns
Ctrl-C into "qkmla COMMAND: interrupted" and SIGTERM into "stopped by SIGTERM". A Ctrl-C there
printed the KeyboardInterrupt traceback of whatever import it hit, and a SIGTERM (a job scheduler's
stop, a `timeout`) ended the process with 143 and not a word, where a second later it said what it
had stopped. Nothing has been read or written yet, so :func:`quiet_interrupts_at_startup` (called
first thing in ``qkmla/__init__.py`` for the command line only) makes each print one line and exit
at once; the command's ``main()`` hands both back (:func:`command_started`) as it starts its work,
where its own handling applies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager


# signal -> (what the line says happened, the handler the command gets back)
_STARTUP = {signal.SIGINT: ("interrupted", signal.default_int_handler),
            signal.SIGTERM: ("stopped by SIGTERM", signal.SIG_DFL),
            signal.SIGHUP: ("stopped by SIGHUP", signal.SIG_DFL)}  # a closed terminal: as SIGTERM (utils.errors)


def _interrupted(command: str):
    def handler(signum, frame):
        try:
            sys.stderr.write(f"qkmla {command}: {_STARTUP[signum][0]} while starting; nothing was done\n")
            sys.stderr.flush()
        finally:
            os._exit(128 + signum)  # a shell's 130 or 143; nothing to unwind or clean up yet

    handler.qkmla_startup = True
    return handler


def quiet_interrupts_at_startup(command: str) -> None:
    """SIGINT and SIGTERM: one line naming ``command``, exit 128 + the signal, until
    :func:`command_started`. Only in the main thread, and only for a signal whose handler is still
    the default one (not ignored, as ``nohup`` or a shell's ``&`` may leave SIGINT, not another's)."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = _interrupted(command)
    for signum, (_, default) in _STARTUP.items():
        if signal.getsignal(signum) is default:
            signal.signal(signum, handler)


def command_started() -> None:
    """Give SIGINT back to Python's KeyboardInterrupt and SIGTERM to its default, where
    :func:`quiet_interrupts_at_startup` holds them."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, (_, default) in _STARTUP.items():
        if getattr(signal.getsignal(signum), "qkmla_startup", False):
            signal.signal(signum, default)


@contextmanager
def sigint_taken():
    """``with sigint_taken():`` a SIGINT that this process was started ignoring (a shell's ``&`` in a script
    ignores it in every background job) is Python's KeyboardInterrupt while the command works, as ``qkmla
    train`` and ``qkmla experiment`` take it: ``kill -INT`` of a background ``qkmla generate --tokens 100000``
    was ignored and the command ran on to its end (60 s, killed). Put back after, for a caller's own Python."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
