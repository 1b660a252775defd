"""How a qkmla command ends: the one runner behind ``qkmla COMMAND`` (``cli.commands.main``) and
``python -m qkmla.train`` (what torchrun launches), so both read the same on every ending.

qkmla's own errors (a refused argument, run directory or file) print one line, ``qkmla COMMAND:
ARGUMENT: message``, and return 2; the machine's (a full disk, a read-only file, memory run out)
one line naming the path, and return 1; a closed stdout (``| head``) ends quietly with 141;
SIGTERM (and SIGHUP), where the command has no handling of its own, unwinds it as Ctrl-C does (its temporaries
removed) and returns 143 with one line; a signal the command handled (``train`` and ``experiment``
checkpoint) is its one line and 128 + the signal's number (one that lands while a C extension
initializes, once it has: :mod:`qkmla.utils.imports`); anything else is a bug and prints its
traceback.
"""

from __future__ import annotations

import sys
import traceback
from typing import Callable, Iterable

from .environment import check_cpu_capability, check_switches, check_transformers_verbosity, drop_bad_thread_counts
from .errors import (Stopped, Terminated, environment_message, flag_message, notice, one_line, quiet_broken_pipe,
                     sigterm_unwinds)
from .imports import extension_inits_held
from .startup import command_started, sigint_taken


def option_dests(parser) -> set:
    """The dests of ``parser``'s options: what :func:`run_command`'s ``option_names`` gives."""
    return {a.dest for a in parser._actions if a.option_strings}


def run_command(command: str, body: Callable[[], int], option_names: Callable[[], Iterable[str]]) -> int:
    """``body()``'s exit status, every ending turned into one line and a status (module docstring).
    ``option_names()``: the dests of the command's options, so that an error naming one names the
    option (``grad_clip: ...`` reads ``--grad-clip: ...``); called only for a refusal."""
    # The command line has dropped them already, before torch loaded (qkmla/__init__.py); this is for
    # a caller in its own Python (a test), where torch has usually read them by now.
    drop_bad_thread_counts(command)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None  # --threads sets it for this call only
    if sys.stdout is None:
        # `qkmla ... >&-`: Python leaves sys.stdout None, and the first print went nowhere (a table, a
        # status line lost without a word) or failed after the work (a finished run reported failed).
        # Refused before any work, as the machine error a C program meets writing there (EBADF).
        notice(f"qkmla {command}: stdout: closed (>&-), so what this command prints would be lost; redirect it to "
               "a file or to /dev/null instead")
        return 1
    restore = _paths_print_as_given()  # {stream: its error handler before}
    try:
        command_started()  # Ctrl-C is KeyboardInterrupt again and SIGTERM its default, handled below (utils.startup)
        # a kill cleans up as Ctrl-C does (train and experiment checkpoint instead); a signal that lands
        # while a C++ extension initializes is acted on as it returns, not raised inside (utils.imports)
        with sigint_taken(), sigterm_unwinds(), extension_inits_held():
            check_switches()  # QKMLA_CPU_KERNEL=junk, refused before any work
            check_cpu_capability()  # ATEN_CPU_CAPABILITY=avx512 without AVX-512: an illegal instruction at step 1
            check_transformers_verbosity()  # junk: transformers' own warning mid-command, the verbosity not set
            status = body()
            sys.stdout.flush()  # a closed pipe shows here, not in Python's flush at exit
        return status
    except Terminated as e:  # SIGTERM or SIGHUP to a command without its own handling: its writing is removed
        notice(f"qkmla {command}: stopped by {e}; nothing half-written is left")
        _end_with_abandoned_work(e.exit_code)
        return e.exit_code  # 128 + the signal, what a shell reports (143 SIGTERM, 129 SIGHUP)
    except Stopped as e:  # a signal, handled: what was done and what is left, in one line
        notice(f"qkmla {command}: {one_line(str(e))}")
        return e.exit_code
    except BrokenPipeError:  # `qkmla ... | head`: the reader has what it wanted
        quiet_broken_pipe()
        return 141  # 128 + SIGPIPE, what a shell reports for a command the pipe stopped
    except ValueError as e:
        notice(f"qkmla {command}: {one_line(flag_message(str(e), option_names()))}")
        return 2
    except KeyboardInterrupt:
        notice(f"qkmla {command}: interrupted")
        _end_with_abandoned_work(130)
        return 130
    except Exception as e:
        message = environment_message(e)
        if message is not None:  # the machine's problem, not qkmla's: one line naming the path
            notice(f"qkmla {command}: {one_line(message)}")
            return 1
        traceback.print_exc()
        print(f"qkmla {command}: internal error: this is a bug in qkmla; please report it with the command "
              "line and the traceback above", file=sys.stderr)
        return 1
    finally:
        if threads is not None:
            torch.set_num_threads(threads)
        for stream, errors in restore.items():
            stream.reconfigure(errors=errors)
        _quiet_exit()


def _end_with_abandoned_work(code: int) -> None:
    """In qkmla's command-line process, a signal that stopped the command while a thread of its work is still
    inside a torch call (a step-memory forward: ``train.step_memory.interruptible``; a rendezvous) ends the
    process here, with ``code``: Python's own exit ran libtorch's destructors under that thread and aborted
    ("terminate called without an active exception", status -6 for a SIGTERM's 143). The command's line is
    said and nothing is written by then. A caller's own Python (a test) is left alone: its thread ends with
    the work."""
    import os
    import threading

    from .environment import command_line_name

    if command_line_name() is None:
        return
    # is_alive() is no guide: a join() the signal interrupted leaves it False for a thread still running
    if any(t.daemon and t.name.startswith("qkmla-") and not getattr(t, "qkmla_done", threading.Event()).is_set()
           for t in threading.enumerate()):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _quiet_exit() -> None:
    """In qkmla's command-line process, once its command has ended (said in its line and status), a Ctrl-C is
    ignored: all that is left is Python's exit, and the second of two Ctrl-Cs (a train checkpointed by the
    first) landed in torch's atexit callback as "Exception ignored in atexit callback ... KeyboardInterrupt"
    with a traceback (round 18, under load). A caller's own Python (a test, a notebook) is left alone."""
    import signal
    import threading

    from .environment import command_line_name

    if threading.current_thread() is threading.main_thread() and command_line_name() is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _paths_print_as_given() -> dict:
    """Let stdout print a path whose name is not UTF-8 (``--out $'\\xff'``: a surrogate escape in
    Python) as the bytes it was given, and stderr as Python's own stderr does (backslashreplace);
    returns {stream: its error handler to restore}. Under a UTF-8 locale stdout is strict: the
    command wrote its file and then failed on its own 'wrote PATH' line, exit 2 with the codec's
    message (and a caller's strict stderr, a test's, failed on a refusal naming such a path)."""
    changed = {}
    for stream, handler in ((sys.stdout, "surrogateescape"), (sys.stderr, "backslashreplace")):
        if getattr(stream, "errors", None) != "strict" or not hasattr(stream, "reconfigure"):
            continue
        try:
            stream.reconfigure(errors=handler)
        except (ValueError, OSError):  # a stream that cannot change its handler now: left as it is
            continue
        changed[stream] = "strict"
    return changed
