"""``python -m qkmla.train`` (what torchrun launches) is ``qkmla train``: the same lines and exit
statuses, from the same dispatcher."""

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ARGS = ["--preset", "debug", "--steps", "2", "--batch-size", "2", "--eval-iters", "1", "--no-progress",
        "--threads", "1"]


def run(argv: list, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkmla.train", *argv], stdout=stdout, stderr=subprocess.PIPE,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)})


def test_a_closed_stdout_ends_quietly_with_the_run_kept(tmp_path):
    """``torchrun -m qkmla.train ... | head -c 10``: the status line's reader is gone once the run is
    done. It ended in a BrokenPipeError traceback; now as ``qkmla train`` does, 141 and no trace."""
    read, write = os.pipe()
    os.close(read)
    try:
        r = run([*ARGS, "--out", str(tmp_path / "r")], stdout=write)
    finally:
        os.close(write)
    assert r.returncode == 141 and "Traceback" not in r.stderr and r.stderr.strip() == "", r.stderr
    assert '"status": "done"' in (tmp_path / "r" / "status.json").read_text()


def test_a_refusal_and_a_result_read_as_qkmla_trains(tmp_path):
    r = run([*ARGS, "--steps", "0"])
    assert r.returncode == 2 and r.stderr.strip() == "qkmla train: --steps: expected an int >= 1, got 0", r.stderr
    r = run([*ARGS, "--out", str(tmp_path / "r")])
    assert r.returncode == 0 and '"status": "done"' in r.stdout, r.stderr
