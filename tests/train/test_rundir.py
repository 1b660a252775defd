"""The run directory: refusal, lock, leftovers, killed runs, strict JSON metrics."""

import json
import math
import os
import subprocess
import sys

import pytest

from qkmla.train.checkpoint import FILENAME
from qkmla.train.config import TrainConfig
from qkmla.train.rundir import metrics_line, read_rows
from qkmla.train.trainer import train

FAST = dict(preset="debug", batch_size=4, block_size=16, eval_interval=3, eval_iters=2, progress=False,
            warmup_steps=2)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_run_directory_is_not_silently_reused(tmp_path):
    first = train(TrainConfig(**FAST, steps=3, out=str(tmp_path)))
    rows = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"already holds a run \(status 'done' at step 3\); pass --resume .* "
                                         r"--overwrite .* new --out"):
        train(TrainConfig(**FAST, steps=5, out=str(tmp_path)))
    assert (tmp_path / "metrics.jsonl").read_text() == rows and first["status"] == "done"
    again = train(TrainConfig(**FAST, steps=2, out=str(tmp_path), overwrite=True))
    assert again["status"] == "done" and len(read_rows(tmp_path / "metrics.jsonl")) == 2


def test_a_second_process_on_the_same_directory_is_refused(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "lock").write_text(json.dumps({"pid": sleeper.pid, "host": os.uname().nodename}))
        with pytest.raises(ValueError, match=f"in use by process {sleeper.pid}"):
            train(TrainConfig(**FAST, steps=2, out=str(tmp_path)))
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_killed_run_is_recognized_and_its_stale_lock_and_leftovers_cleared(tmp_path, capsys):
    train(TrainConfig(**FAST, steps=4, ckpt_interval=2, out=str(tmp_path)))
    # What kill -9 in the middle of a checkpoint write leaves behind:
    pid = dead_pid()
    (tmp_path / "lock").write_text(json.dumps({"pid": pid, "host": os.uname().nodename}))
    (tmp_path / "status.json").write_text(json.dumps({"status": "running", "pid": pid, "step": 4,
                                                      "checkpoint_step": 4}))
    (tmp_path / (FILENAME + ".tmp123")).write_bytes(b"half a checkpoint")
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 3.')  # the last row, cut short
    status = train(TrainConfig(**FAST, steps=6, out=str(tmp_path), resume=True))
    out = capsys.readouterr().out
    assert "removed 1 unfinished checkpoint write" in out and f"was killed (pid {pid}, last logged step 4)" in out
    assert status["status"] == "done" and not list(tmp_path.glob("*.tmp*")) and not (tmp_path / "lock").exists()
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_without_out_a_fresh_directory_is_made_and_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    a = train(TrainConfig(**FAST, steps=1))
    b = train(TrainConfig(**FAST, steps=1))
    assert a["out"] != b["out"] and a["out"].startswith("runs/debug-mla-qknorm-")
    assert f"writing the run to {a['out']}" in capsys.readouterr().out


def test_status_says_failed_with_the_error_step_and_checkpoint(tmp_path, monkeypatch):
    from qkmla.train import trainer

    calls = []

    def broken_evaluate(*args):
        calls.append(1)
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(trainer, "evaluate", broken_evaluate)
    with pytest.raises(RuntimeError, match="disk on fire"):
        train(TrainConfig(**FAST, steps=9, ckpt_interval=2, out=str(tmp_path)))
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and status["error"] == "RuntimeError: disk on fire"
    assert status["step"] == 2 and status["checkpoint_step"] == 2 and status["last_checkpoint"].endswith(FILENAME)


def test_interrupt_checkpoints_and_resumes_with_the_same_losses(tmp_path, monkeypatch):
    """Ctrl-C between steps 3 and 4 checkpoints step 3; the resumed run equals an uninterrupted one."""
    from qkmla.train import trainer

    full = train(TrainConfig(**FAST, steps=6, ckpt_interval=100, out=str(tmp_path / "full")))
    real, calls = trainer.get_batch, []

    def interrupt_fourth(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(trainer, "get_batch", interrupt_fourth)
    part = TrainConfig(**FAST, steps=6, ckpt_interval=100, out=str(tmp_path / "part"))
    status = train(part)
    assert status["status"] == "interrupted" and status["step"] == 3 and status["checkpoint_step"] == 3
    monkeypatch.setattr(trainer, "get_batch", real)
    assert train(part.replace(resume=True))["status"] == full["status"] == "done"
    losses = [[r["loss"] for r in read_rows(tmp_path / d / "metrics.jsonl")] for d in ("full", "part")]
    assert losses[0] == losses[1] and len(losses[0]) == 6


def test_non_finite_weights_are_never_saved(tmp_path, monkeypatch):
    """A step that leaves NaN weights (here injected into the optimizer's step) ends the run
    before its checkpoint: the file keeps the last finite weights."""
    from qkmla.train import trainer
    from qkmla.train.checkpoint import read_checkpoint

    real_build = trainer.build_optimizer

    def poisoned(*args, **kwargs):
        opt = real_build(*args, **kwargs)
        step, count = opt.step, []

        def step_then_poison():
            step()
            count.append(1)
            if len(count) == 2:
                opt.param_groups[0]["params"][0].data.fill_(float("nan"))
        opt.step = step_then_poison
        return opt

    monkeypatch.setattr(trainer, "build_optimizer", poisoned)
    status = train(TrainConfig(**FAST, steps=6, ckpt_interval=1, out=str(tmp_path)))
    assert status["status"] == "non-finite" and "not finite after step 2" in status["error"]
    state, _, meta = read_checkpoint(tmp_path)
    assert meta["step"] == "1" and all(bool(v.isfinite().all()) for v in state.values())


def test_metrics_lines_are_strict_json():
    line = metrics_line({"step": 1, "loss": 2.0, "grad_norm": math.inf, "per": [1.0, math.nan]})

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    row = json.loads(line, parse_constant=refuse)
    assert row == {"step": 1, "loss": 2.0, "grad_norm": None, "per": [1.0, None], "non_finite": ["grad_norm", "per"]}
