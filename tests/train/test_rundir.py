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
ONE_STEP = {**FAST, "warmup_steps": 1}  # a warmup no longer than the run (TrainConfig refuses a longer one)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_run_directory_is_not_silently_reused(tmp_path):
    first = train(TrainConfig(**FAST, steps=3, out=str(tmp_path)))
    rows = (tmp_path / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"already holds a run with status 'done' at step 3; pass --resume .* "
                                         r"--overwrite .* new --out"):
        train(TrainConfig(**FAST, steps=5, out=str(tmp_path)))
    assert (tmp_path / "metrics.jsonl").read_text() == rows and first["status"] == "done"
    again = train(TrainConfig(**FAST, steps=2, out=str(tmp_path), overwrite=True))
    assert again["status"] == "done" and len(read_rows(tmp_path / "metrics.jsonl")) == 2


HOLD_LOCK = """
import sys, time
from qkmla.train.rundir import RunLock
with RunLock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_a_second_process_on_the_same_directory_is_refused(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=f"in use by process {holder.pid} on .*lock file"):
            train(TrainConfig(**FAST, steps=2, out=str(tmp_path)))
        assert not (tmp_path / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    # The kernel freed the killed holder's lock: the directory is usable at once.
    assert train(TrainConfig(**FAST, steps=2, out=str(tmp_path)))["status"] == "done"


def _take(path, barrier, results):
    from qkmla.train.rundir import RunLock

    barrier.wait()
    try:
        with RunLock(path):
            results.put("got")
            barrier.wait()  # hold it until both have tried
    except ValueError:
        results.put("refused")
        barrier.wait()


def test_two_processes_racing_for_one_directory_never_both_get_it(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for trial in range(20):
        path = tmp_path / str(trial)
        path.mkdir()
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_take, args=(path, barrier, results)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
        assert sorted(results.get(timeout=5) for _ in range(2)) == ["got", "refused"]


def test_a_killed_run_is_recognized_and_its_leftovers_cleared(tmp_path, capsys):
    train(TrainConfig(**FAST, steps=4, ckpt_interval=2, out=str(tmp_path)))
    # What kill -9 in the middle of a checkpoint write leaves behind:
    pid = dead_pid()
    (tmp_path / "lock").write_text(json.dumps({"pid": pid, "host": os.uname().nodename}))  # not flock-ed any more
    (tmp_path / "status.json").write_text(json.dumps({"status": "running", "pid": pid, "step": 4,
                                                      "checkpoint_step": 4}))
    (tmp_path / (FILENAME + ".tmp123")).write_bytes(b"half a checkpoint")
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "loss": 3.')  # the last row, cut short
    with pytest.raises(ValueError, match=f"holds a run that was killed \\(pid {pid}\\) after logging step 4, with "
                                         "its last checkpoint at step 4; pass --resume"):
        train(TrainConfig(**FAST, steps=6, out=str(tmp_path)))
    status = train(TrainConfig(**FAST, steps=6, out=str(tmp_path), resume=True))
    out = capsys.readouterr().out
    assert "removed 1 unfinished checkpoint write" in out and f"was killed (pid {pid}, last logged step 4)" in out
    assert status["status"] == "done" and not list(tmp_path.glob("*.tmp*")) and not (tmp_path / "lock").exists()
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_status_says_how_far_a_running_run_got(tmp_path, monkeypatch):
    """status.json is rewritten at every checkpoint, so a run killed later says where it was."""
    from qkmla.train import trainer

    seen = []
    real = trainer.write_status

    def spy(out, status):
        real(out, status)
        seen.append(json.loads((out / "status.json").read_text()))

    monkeypatch.setattr(trainer, "write_status", spy)
    train(TrainConfig(**FAST, steps=4, ckpt_interval=2, out=str(tmp_path)))
    assert [(s["status"], s["step"], s["checkpoint_step"]) for s in seen] == [
        ("running", 0, 0), ("running", 2, 2), ("running", 4, 4), ("done", 4, 4)]


def test_without_out_a_fresh_directory_is_made_and_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    a = train(TrainConfig(**ONE_STEP, steps=1))
    b = train(TrainConfig(**ONE_STEP, steps=1))
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


@pytest.mark.parametrize("signame, status", [("SIGINT", "interrupted"), ("SIGTERM", "stopped")])
def test_a_stop_signal_stops_after_the_step_with_a_checkpoint_and_resumes_exactly(tmp_path, monkeypatch, signame,
                                                                                   status):
    """Ctrl-C (SIGINT), or SIGTERM as Slurm, Kubernetes and docker stop send it (issue 27, class 4),
    in the middle of step 4 finishes that step, checkpoints it, restores the handler and stops
    with its status ("interrupted", "stopped"); the resumed run equals an uninterrupted one. A
    second signal stops at once."""
    import signal

    from qkmla.train import trainer

    sig = getattr(signal, signame)
    full = train(TrainConfig(**FAST, steps=7, ckpt_interval=100, out=str(tmp_path / "full")))
    real, calls = trainer.get_batch, []

    def signal_in_step_four(*args):
        calls.append(1)
        batch = real(*args)
        if len(calls) == 4:
            signal.raise_signal(sig)
        return batch

    monkeypatch.setattr(trainer, "get_batch", signal_in_step_four)
    part = TrainConfig(**FAST, steps=7, ckpt_interval=100, out=str(tmp_path / "part"))
    before = signal.getsignal(sig)  # Python's default, or SIG_IGN in a background job
    stopped = train(part)
    assert stopped["status"] == status and stopped["step"] == 4 and stopped["checkpoint_step"] == 4
    assert signal.getsignal(sig) is before  # restored
    monkeypatch.setattr(trainer, "get_batch", real)
    assert train(part.replace(resume=True))["status"] == full["status"] == "done"
    losses = [[r["loss"] for r in read_rows(tmp_path / d / "metrics.jsonl")] for d in ("full", "part")]
    assert losses[0] == losses[1] and len(losses[0]) == 7

    calls.clear()

    def twice(*args):
        calls.append(1)
        if len(calls) == 2:
            signal.raise_signal(sig)
            signal.raise_signal(sig)
        return real(*args)

    monkeypatch.setattr(trainer, "get_batch", twice)
    now = train(TrainConfig(**FAST, steps=7, ckpt_interval=1, out=str(tmp_path / "now")))
    assert now["status"] == status and now["step"] == 1 and now["checkpoint_step"] == 1


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


def test_damaged_lines_are_skipped_and_the_rows_around_them_kept(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnull\n{"step": 2, "lo\n{"loss": 1}\n{"step": 3}\n')
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1, 3]


def test_a_run_with_a_damaged_line_that_is_not_utf8_resumes(tmp_path):
    """read_rows skips such a line as it skips any damaged one (and plot draws the rows around it);
    resume refused the whole run over it, as "not a qkmla run's file (not text)"."""
    train(TrainConfig(**FAST, steps=2, out=str(tmp_path)))
    with open(tmp_path / "metrics.jsonl", "ab") as f:
        f.write(b"\xff\xfe damaged\n")
    assert train(TrainConfig(**FAST, steps=4, out=str(tmp_path), resume=True))["status"] == "done"
    assert [r["step"] for r in read_rows(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "metrics.jsonl").write_bytes(b"\x00\xff" * 100)  # no row at all: not a run's
    with pytest.raises(ValueError, match="metrics.jsonl is not a qkmla run's file .lines that are not metrics rows"):
        train(TrainConfig(**FAST, steps=2, out=str(tmp_path / "other"), overwrite=True))


def test_metrics_lines_are_strict_json():
    line = metrics_line({"step": 1, "loss": 2.0, "grad_norm": math.inf, "per": [1.0, math.nan]})

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    row = json.loads(line, parse_constant=refuse)
    assert row == {"step": 1, "loss": 2.0, "grad_norm": None, "per": [1.0, None], "non_finite": ["grad_norm", "per"]}


def test_record_edits_are_the_changes_a_resume_would_lose(tmp_path):
    """config.json against the checkpoint's record and the config a resume writes: a field
    changed in the file alone is an edit; one the resume changes (steps), or one a resume killed
    before its first checkpoint wrote (file == now), is not."""
    from qkmla.train.rundir import record_edits, text_digest

    recorded = {"train": {"steps": 3, "lr": 0.001, "seed": 1}, "model": {"n_embd": 64}, "data": {"sha256": "a"}}
    now = {"train": {"steps": 5, "lr": 0.001, "seed": 1}, "model": {"n_embd": 64}, "data": {"sha256": "a"}}
    path = tmp_path / "config.json"
    assert record_edits(path, recorded, now) == []  # no file: nothing to lose
    for saved, edits in (
            (recorded, []),  # as the run wrote it; the resume changes steps
            (now, []),  # written by a resume killed before its first checkpoint
            ({**recorded, "train": {"steps": 3, "lr": 0.5, "seed": 1}},
             ["train.lr: 0.5 in the file, 0.001 recorded"]),
            ({**recorded, "train": {"steps": 3, "lr": 0.001}}, ["train.seed: absent in the file, 1 recorded"]),
            ({**recorded, "data": {"sha256": "b"}}, ['data: {"sha256": "b"} in the file, {"sha256": "a"} recorded'])):
        path.write_text(json.dumps(saved))
        assert record_edits(path, recorded, now) == edits
    # A resume killed before its first checkpoint wrote lr 0.002; the next one asks for 0.003: the
    # file matches neither record nor now, and is still qkmla's own by the digest its status keeps.
    killed = json.dumps({**recorded, "train": {"steps": 5, "lr": 0.002, "seed": 1}}, indent=1)
    path.write_text(killed)
    later = {**now, "train": {"steps": 5, "lr": 0.003, "seed": 1}}
    assert record_edits(path, recorded, later) == ["train.lr: 0.002 in the file, 0.001 recorded, 0.003 now"]
    assert record_edits(path, recorded, later, written=(text_digest(killed),)) == []
    path.write_text(killed.replace("0.002", "0.5"))  # edited after that write: the digest no longer vouches for it
    assert record_edits(path, recorded, later, written=(text_digest(killed),)) == [
        "train.lr: 0.5 in the file, 0.001 recorded, 0.003 now"]
    path.write_text('{"train": {"st')
    assert record_edits(path, recorded, now) == ["not readable JSON: damaged or cut short"]
    path.write_text("[1, 2]")
    assert record_edits(path, recorded, now) == ["not a JSON object"]


def test_a_resume_with_no_checkpoint_says_how_to_go_on(tmp_path):
    """A run stopped before its first checkpoint (a full disk at it): resume said only "no
    checkpoint" (probe 8, noticed and left); it names --overwrite, which starts the run over."""
    train(TrainConfig(**FAST, steps=2, out=str(tmp_path)))
    (tmp_path / FILENAME).unlink()
    with pytest.raises(ValueError, match="resume: no checkpoint in .*; pass --overwrite to start the run over"):
        train(TrainConfig(**FAST, steps=4, out=str(tmp_path), resume=True))
    assert train(TrainConfig(**FAST, steps=2, out=str(tmp_path), overwrite=True))["status"] == "done"


def test_a_finished_run_whose_checkpoint_was_deleted_is_not_said_to_have_stopped_early(tmp_path):
    """dc9dbe4's refusal said of any run without a checkpoint that it "stopped before its first"; a done run whose
    checkpoint was removed had written one."""
    out = tmp_path / "run"
    assert train(TrainConfig(**FAST, steps=2, out=str(out)))["status"] == "done"
    (out / FILENAME).unlink()
    with pytest.raises(ValueError, match=r"with no checkpoint to resume from \(its checkpoint is gone\); pass "
                                         r"--overwrite"):
        train(TrainConfig(**FAST, steps=2, out=str(out)))
