"""Ctrl-C while qkmla's command line starts: one line and exit 130, not a traceback.

``python -m qkmla COMMAND`` (and the ``qkmla`` script, ``python -m qkmla.train``) spends its first
seconds importing torch and building the parser, before ``main()`` reaches the ``try`` that turns
Ctrl-C into "qkmla COMMAND: interrupted". A Ctrl-C there printed the KeyboardInterrupt traceback of
whatever import it hit. Nothing has been read or written yet, so :func:`quiet_interrupts_at_startup`
(called first thing in ``qkmla/__init__.py`` for the command line only) makes SIGINT print one line
and exit at once; the command's ``main()`` hands SIGINT back to Python's own handler
(:func:`command_started`) as it starts its work, where its own handling applies.
"""

from __future__ import annotations

import os
import signal
import sys
import threading


def _interrupted(command: str):
    def handler(signum, frame):
        try:
            sys.stderr.write(f"qkmla {command}: interrupted while starting; nothing was done\n")
            sys.stderr.flush()
        finally:
            os._exit(128 + signal.SIGINT)  # a shell's 130; nothing to unwind or clean up yet

    handler.qkmla_startup = True
    return handler


def quiet_interrupts_at_startup(command: str) -> None:
    """SIGINT: one line naming ``command``, exit 130, until :func:`command_started`. Only in the
    main thread, and only where SIGINT is Python's default handler (not ignored, not another's)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted(command))


def command_started() -> None:
    """Give SIGINT back to Python's KeyboardInterrupt, if :func:`quiet_interrupts_at_startup` holds it."""
    if threading.current_thread() is threading.main_thread() and \
            getattr(signal.getsignal(signal.SIGINT), "qkmla_startup", False):
        signal.signal(signal.SIGINT, signal.default_int_handler)
