"""Issue 27, class 6: --threads, and auto's choice on a shared machine."""

import re
import subprocess
import sys

import pytest
import torch

from qkmla.utils import threads
from qkmla.cli import main


def test_auto_takes_torchs_count_less_the_busy_cores(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert threads.auto_threads(busy=0.0)[0] == 4  # idle: what torch takes anyway
    assert threads.auto_threads(busy=0.3)[0] == 4
    assert threads.auto_threads(busy=1.0) == (3, "1 of 4 cores busy")
    assert threads.auto_threads(busy=3.9)[0] == 1  # never below one
    assert threads.auto_threads(local_ranks=2, busy=1.0) == (1, "1 of 4 cores busy, 2 ranks")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # OMP_NUM_THREADS=2 caps it
    assert threads.auto_threads(busy=0.0)[0] == 2


def test_a_spinning_process_counts_as_a_busy_core():
    if threads._cpu_times(threads.usable_cpus()) is None:
        pytest.skip("no /proc/stat here")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert threads.busy_cpus(0.5) >= 0.7
    finally:
        spinner.kill()
        spinner.wait()


def test_threads_option(monkeypatch, refused, capsys, tmp_path):
    """--threads N sets torch's count for the command and the old count is back after it; a
    bad value is one line naming the option; auto below torch's count says so on stderr."""
    seen = []
    monkeypatch.setattr("qkmla.train.trainer.train", lambda config: seen.append(torch.get_num_threads()) or
                        {"status": "done"})
    before = torch.get_num_threads()
    assert main(["train", "--threads", "3", "--out", str(tmp_path)]) == 0
    assert seen == [3] and torch.get_num_threads() == before
    monkeypatch.setattr(threads, "busy_cpus", lambda seconds=0.3: float(len(threads.usable_cpus())))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    capsys.readouterr()
    assert main(["train", "--out", str(tmp_path)]) == 0
    assert "qkmla train: 1 thread (" in capsys.readouterr().err
    for argv in (["train"], ["demo"], ["generate", "run"], ["convert", "x", "--out", "y"]):
        with pytest.raises(SystemExit):
            main(argv + ["--threads", "0"])
        assert re.search(r"--threads: expected a positive int up to \d+ \(4 per CPU this process may run on\) or "
                         r"'auto', got '0'", capsys.readouterr().err)
