"""A Ctrl-C or SIGTERM while qkmla's command line starts (torch importing): one line, 130 or 143."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(SRC)})


@pytest.mark.parametrize("signum, code, says", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "stopped by SIGTERM")])
def test_a_signal_while_starting_is_one_line(signum, code, says):
    """Before the SIGTERM half, a SIGTERM in the first seconds of `qkmla train` ended it with 143 and
    not a word (a second later: "stopped by SIGTERM; nothing half-written is left")."""
    r = python(f"""
        import os, signal, time
        from qkmla.utils.startup import quiet_interrupts_at_startup
        quiet_interrupts_at_startup("train")
        os.kill(os.getpid(), {int(signum)})
        time.sleep(30)
        print("not stopped")
    """)
    assert r.returncode == code and r.stdout == "", (r.returncode, r.stdout, r.stderr)
    assert r.stderr == f"qkmla train: {says} while starting; nothing was done\n"


def test_the_command_gets_both_back_as_it_starts():
    r = python("""
        import signal
        from qkmla.utils.startup import command_started, quiet_interrupts_at_startup
        quiet_interrupts_at_startup("verify")
        held = [getattr(signal.getsignal(s), "qkmla_startup", False) for s in (signal.SIGINT, signal.SIGTERM)]
        command_started()
        print(held, signal.getsignal(signal.SIGINT) is signal.default_int_handler,
              signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    """)
    assert r.stdout.split() == ["[True,", "True]", "True", "True"], r.stderr


def test_a_signal_someone_else_handles_or_ignores_is_left_alone():
    """Under a launcher that ignores SIGTERM (or a program that handles it) before importing qkmla."""
    r = python("""
        import signal
        from qkmla.utils.startup import command_started, quiet_interrupts_at_startup
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        quiet_interrupts_at_startup("verify")
        command_started()
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)
    """)
    assert r.stdout.strip() == "True", r.stderr
