import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkmla.train.trainer import TrainConfig, load_model, train

FAST = dict(preset="debug", batch_size=4, block_size=16, eval_interval=3, eval_iters=2, progress=False,
            warmup_steps=2)
ONE_STEP = {**FAST, "warmup_steps": 1}  # a warmup no longer than the run (TrainConfig refuses a longer one)


def read(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_gives_the_same_losses(tmp_path, optimizer):
    full = train(TrainConfig(**FAST, steps=8, optimizer=optimizer, out=str(tmp_path / "full"), ckpt_interval=8))
    assert full["status"] == "done"
    part = TrainConfig(**FAST, steps=8, optimizer=optimizer, out=str(tmp_path / "part"), ckpt_interval=4)
    train(TrainConfig(**{**part.__dict__, "max_seconds": 0.0}))  # stops after its first step, checkpointed
    assert json.loads((tmp_path / "part" / "status.json").read_text())["status"] == "time limit"
    train(TrainConfig(**{**part.__dict__, "resume": True}))
    a, b = read(tmp_path / "full"), read(tmp_path / "part")
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]


def test_metrics_rows(tmp_path):
    train(TrainConfig(**FAST, steps=3, attn="mla", log_heads=True, out=str(tmp_path)))
    rows = read(tmp_path)
    assert len(rows) == 3
    for r in rows:
        assert {"step", "loss", "lr", "grad_norm", "max_logit", "tokens_per_s", "max_logit_seconds"} <= set(r)
        assert len(r["max_logit_per_layer"]) == 2 and len(r["max_logit_per_head"][0]) == 4
        assert r["max_logit"] == pytest.approx(max(max(h) for h in r["max_logit_per_head"]), abs=1e-3)
    assert "val_loss" in rows[2]
    model, tok = load_model(tmp_path)
    assert model.config.attn == "mla" and tok.vocab_size == 65


def test_qk_clip_in_training_holds_logits_down(tmp_path):
    """tau below the initial logits: every step clips, and the max logits stay far
    below those of the same run without QK-Clip."""
    cfg = dict(FAST, steps=6, attn="mla", lr=3e-2)
    free = train(TrainConfig(**cfg, out=str(tmp_path / "free")))
    clipped = train(TrainConfig(**cfg, qk_clip=0.05, out=str(tmp_path / "clip")))
    assert free["status"] == clipped["status"] == "done"
    rows, free_rows = read(tmp_path / "clip"), read(tmp_path / "free")
    assert all(r["clipped_heads"] > 0 for r in rows)
    assert rows[-1]["max_logit"] < 0.5 * free_rows[-1]["max_logit"]
    # Each clipped step also logs the max logit measured through the clipped weights.
    assert all(r["max_logit"] > 0.05 and r["max_logit_after_clip"] > 0 for r in rows)
    assert all("max_logit_after_clip" not in r and r.get("clipped_heads") is None for r in free_rows)


def test_max_logit_after_clip_is_what_the_clipped_weights_give(tmp_path):
    """The logged value is the max logit of the final (updated, clipped) weights on the last
    step's batch, recomputed here from the checkpoint and the replayed batch; it is not
    min(S, tau), which would be tau on every clipped step."""
    import torch

    from qkmla.train.data import Corpus, get_batch
    from qkmla.train.diagnostics import forward_max_logits

    tau = 0.05
    cfg = TrainConfig(**FAST, steps=3, attn="mla", lr=3e-2, qk_clip=tau, ckpt_interval=3, out=str(tmp_path))
    train(cfg)
    rows = read(tmp_path)
    assert all(r["clipped_heads"] > 0 for r in rows)
    generator = torch.Generator().manual_seed(cfg.seed)
    for _ in range(cfg.steps):  # the trainer draws one batch per step from this generator
        x, _ = get_batch(Corpus.load().train, cfg.batch_size, 16, generator)
    model, _ = load_model(tmp_path)
    measured = forward_max_logits(model, x)  # [layers, h]
    assert rows[-1]["max_logit_after_clip"] == pytest.approx(float(measured.max()), rel=1e-5)
    assert rows[-1]["max_logit_after_clip_per_layer"] == pytest.approx(measured.amax(dim=1).tolist(), abs=1e-4)  # rounded to 4 places
    assert all(abs(r["max_logit_after_clip"] - tau) > 1e-3 * tau for r in rows)


def test_validation_windows_do_not_depend_on_the_seed(tmp_path):
    """Runs with different seeds are scored on the same windows: one model, two seeds' configs,
    one loss; and a seed-1 run's reported val loss is that model's loss on those windows."""
    from qkmla.train.data import Corpus
    from qkmla.train.trainer import evaluate

    run = TrainConfig(**FAST, steps=3, seed=1, out=str(tmp_path))
    train(run)
    model, _ = load_model(tmp_path)
    val = Corpus.load().val
    a = evaluate(model, val, run, 16)
    assert a == evaluate(model, val, TrainConfig(**{**run.__dict__, "seed": 2}), 16)
    assert read(tmp_path)[-1]["val_loss"] == pytest.approx(a, rel=1e-6)


def test_qk_clip_refused_for_qk_norm(tmp_path):
    with pytest.raises(ValueError, match="qk_clip"):
        train(TrainConfig(**ONE_STEP, steps=1, attn="mla-qknorm", qk_clip=100.0, out=str(tmp_path)))


def test_nan_stops_cleanly_and_keeps_last_checkpoint(tmp_path):
    # no weight decay: lr 1e30 times any is refused (each step would flip the weights' sign)
    status = train(TrainConfig(**{**FAST, "warmup_steps": 0}, steps=50, lr=1e30, weight_decay=0.0, grad_clip=0.0,
                               attn="mha", ckpt_interval=1, out=str(tmp_path)))
    assert status["status"] == "non-finite"
    assert status["last_checkpoint"] is not None and Path(status["last_checkpoint"]).is_file()
    saved = json.loads((tmp_path / "status.json").read_text())
    assert saved["step"] == status["step"] < 50
    assert len(read(tmp_path)) == status["step"]  # every finished step was logged


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_match_one(tmp_path, mode):
    """torchrun --nproc_per_node 2 on gloo (DDP, or FSDP2) gives the losses of one process with
    the same global batch."""
    args = ["--preset", "debug", "--batch-size", "4", "--block-size", "16", "--steps", "3", "--eval-interval", "3",
            "--eval-iters", "1", "--no-progress", "--attn", "mla-qknorm"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "qkmla.train", *args, "--out", str(tmp_path / "one")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    extra = ["--fsdp"] if mode == "fsdp" else []

    def run_two(out: Path, *more):
        return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               "-m", "qkmla.train", *args, *extra, "--out", str(out), *more],
                              capture_output=True, text=True, env=env, timeout=300)

    out = tmp_path / "two"
    two = run_two(out)
    if two.returncode != 0 and "terminate called without an active exception" in two.stderr:
        # A rank aborted by std::terminate from a C++ thread (seen once in seven runs on a loaded
        # 2-core machine, in the FSDP case, and not in six reruns; pytorch/pytorch#190489 and
        # #179291 show gloo's threads doing this around process-group teardown): one more run,
        # which must succeed.
        out = tmp_path / "two-again"
        two = run_two(out)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = read(tmp_path / "one"), read(out)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    assert (out / "checkpoint.safetensors").is_file()
    # Resumed by two processes as by one. Under FSDP every resume failed in a collective mismatch:
    # the checkpoint's tensors came back in another order on each rank, and the full-state-dict load
    # scatters them one by one in the order given.
    resumed = run_two(out, "--resume", "--steps", "5")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "qkmla.train", *args, "--out", str(tmp_path / "one"), "--resume",
                          "--steps", "5"], capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    a, b = read(tmp_path / "one"), read(out)
    assert len(a) == len(b) == 5
    assert [ra["loss"] for ra in a[3:]] == pytest.approx([rb["loss"] for rb in b[3:]], rel=1e-5)


def test_resume_refuses_a_different_model_and_lists_the_differences(tmp_path):
    train(TrainConfig(**FAST, steps=2, out=str(tmp_path)))
    with pytest.raises(ValueError, match=r"(?s)trained differently.*attn: stored 'mla-qknorm', now "
                                         r"'mla-qknorm-unified'.*block_size: stored 16, now 32"):
        train(TrainConfig(**{**FAST, "block_size": 32}, steps=4, attn="mla-qknorm-unified", out=str(tmp_path),
                          resume=True))
    # What may change on resume does: more steps, another lr and eval interval.
    status = train(TrainConfig(**{**FAST, "eval_interval": 2}, steps=4, lr=2e-3, out=str(tmp_path), resume=True))
    assert status["status"] == "done" and status["step"] == 4


def test_a_corrupt_checkpoint_is_one_clear_error(tmp_path):
    from qkmla.train.checkpoint import FILENAME, CheckpointError, read_checkpoint

    train(TrainConfig(**FAST, steps=2, out=str(tmp_path)))
    path = tmp_path / FILENAME
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte inside the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path} is corrupt: 1 tensor"):
        read_checkpoint(tmp_path)
    path.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CheckpointError, match=f"{path} is truncated or corrupt"):
        train(TrainConfig(**FAST, steps=4, out=str(tmp_path), resume=True))


def test_data_too_short_for_a_block_is_refused_before_training(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("abcdefghij" * 10)  # 100 characters: 10 in the validation split
    with pytest.raises(ValueError, match="validation split has 10 tokens, too few for one block of block_size=16"):
        train(TrainConfig(**FAST, steps=2, data=str(text), out=str(tmp_path / "run")))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty.txt is empty"):
        train(TrainConfig(**FAST, steps=2, data=str(tmp_path / "empty.txt"), out=str(tmp_path / "run2")))


def test_collective_timeout_ends_a_torchrun_job_with_a_clear_message(tmp_path):
    """Two gloo ranks; rank 1 is stopped (SIGSTOP) mid-run. Rank 0 gives up after
    --dist-timeout seconds with a one-line reason, status.json says the same, and the last
    checkpoint stays."""
    import signal
    import time

    out = tmp_path / "run"
    args = ["--preset", "debug", "--batch-size", "4", "--block-size", "16", "--steps", "10000", "--eval-interval",
            "10000", "--eval-iters", "1", "--no-progress", "--attn", "mla", "--ckpt-interval", "1",
            "--dist-timeout", "3", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "qkmla.train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=env)

    def rank_pid(rank):
        for d in Path("/proc").iterdir():
            try:
                cmd, environ = (d / "cmdline").read_bytes(), (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(out).encode() in cmd and b"torch.distributed.run" not in cmd and f"RANK={rank}".encode() in environ:
                return int(d.name)

    stopped = None
    try:
        deadline = time.time() + 120
        while len(read(out)) < 3 if (out / "metrics.jsonl").is_file() else True:
            assert time.time() < deadline and job.poll() is None, "the job did not start"
            time.sleep(0.2)
        stopped = rank_pid(1)
        os.kill(stopped, signal.SIGSTOP)
        while json.loads((out / "status.json").read_text())["status"] == "running":
            assert time.time() < deadline, "rank 0 did not time out"
            time.sleep(0.2)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGKILL)
        _, err = job.communicate(timeout=120)
    assert job.returncode != 0
    status = json.loads((out / "status.json").read_text())
    assert status["status"] == "failed" and "waited more than dist_timeout=3 s" in status["error"]
    assert "qkmla train: rank 0: a collective waited more than dist_timeout=3 s" in err
    assert status["last_checkpoint"] and Path(status["last_checkpoint"]).is_file()


def test_resume_compares_the_model_and_the_data_not_how_they_were_spelled(tmp_path, monkeypatch):
    """The preset's own block size given explicitly, or the same data file by another path,
    resumes; a data file whose text changed under the same path does not."""
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    train(TrainConfig(**{**FAST, "block_size": None}, steps=2, data="text.txt", out=str(run)))
    status = train(TrainConfig(**{**FAST, "block_size": 32}, steps=3, data=str(data), out=str(run), resume=True))
    assert status["status"] == "done"
    data.write_text("the quick brown fox jumps over the lazy cat. " * 40)
    with pytest.raises(ValueError, match="data: the text differs from the stored run's"):
        train(TrainConfig(**{**FAST, "block_size": 32}, steps=4, data=str(data), out=str(run), resume=True))
    with pytest.raises(ValueError, match="steps: the run in .* is already at step 3"):
        data.write_text("the quick brown fox jumps over the lazy dog. " * 40)
        train(TrainConfig(**{**FAST, "block_size": 32}, steps=3, data=str(data), out=str(run), resume=True))


def test_a_flipped_metadata_byte_is_caught(tmp_path):
    from qkmla.train.checkpoint import FILENAME, CheckpointError, read_checkpoint

    train(TrainConfig(**FAST, steps=2, out=str(tmp_path)))
    path = tmp_path / FILENAME
    data = bytearray(path.read_bytes())
    i = data.find(b"dropout")
    data[i + 2] ^= 1  # "dropout" -> "drnpout": still valid JSON, a different config
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path} is corrupt: its metadata .* fails its checksum"):
        read_checkpoint(tmp_path)


def test_out_that_cannot_be_a_directory_is_refused(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="out: cannot make the run directory .*afile"):
        train(TrainConfig(**ONE_STEP, steps=1, out=str(tmp_path / "afile")))
    with pytest.raises(ValueError, match="out: expected a directory path or None"):
        TrainConfig(**FAST, out="")
    (tmp_path / "d" / FILENAME_DIR).mkdir(parents=True)
    with pytest.raises(ValueError, match="is a directory where the run's file goes"):
        train(TrainConfig(**ONE_STEP, steps=1, out=str(tmp_path / "d"), overwrite=True))
    with pytest.raises(ValueError, match="qk_norm_p: only the -lp variants use p"):
        TrainConfig(**FAST, qk_norm_p=3.0, attn="mla-qknorm")
    # The seed's range reads as a number the user can type back (not 9.22337e+18); the same check as
    # generate's and verify's --seed.
    with pytest.raises(ValueError, match=r"seed: expected an int from 0 to 2\*\*32 - 1 .*, got -1$"):
        TrainConfig(**FAST, seed=-1)
    with pytest.raises(ValueError, match=r"seed: expected an int from 0 to 2\*\*32 - 1 .*, got 10{23}$"):
        TrainConfig(**FAST, seed=10**23)
    # A fresh run past 2**32 - 1 is refused (it would repeat a smaller seed's run); a resume reads no seed, so a run
    # an earlier qkmla trained with one (taken up to 2**63 - 1 then) still resumes (found by round 19's review:
    # both of the refusal's ways out were refused too).
    with pytest.raises(ValueError, match=r"seed: expected an int from 0 to 2\*\*32 - 1 .*, got 4294968633$"):
        TrainConfig(**FAST, seed=2**32 + 1337)
    assert TrainConfig(**FAST, seed=2**32 + 1337, resume=True, out=str(tmp_path)).seed == 2**32 + 1337
    with pytest.raises(ValueError, match=r"seed: expected an int from 0 to 2\*\*32 - 1 .*, got 10{23}$"):
        TrainConfig(**FAST, seed=10**23, resume=True, out=str(tmp_path))


FILENAME_DIR = "checkpoint.safetensors"


def test_integer_weights_in_a_checkpoint_are_refused(tmp_path):
    """Issue 27, class 3: load_state_dict would cast them to float silently."""
    import torch

    from qkmla.train.checkpoint import read_checkpoint, read_metadata, save_checkpoint

    train(TrainConfig(**ONE_STEP, steps=1, out=str(tmp_path)))
    state, tensors, meta = read_checkpoint(tmp_path)
    state = {k: (v.round().long() if k == "lm_head.weight" else v) for k, v in state.items()}
    optim = {}
    save_checkpoint(tmp_path / "ints", state, optim, 1, json.loads(read_metadata(tmp_path / FILENAME_DIR)["config"]),
                    torch.Generator())
    with pytest.raises(ValueError, match=r"checkpoint .*ints: holds integer weights where the model has "
                                         r"floating-point ones: (lm_head|wte)\.weight \(torch.int64\)"):
        load_model(tmp_path / "ints")


def test_a_sigterm_sent_to_qkmla_train_checkpoints_and_a_new_process_resumes_exactly(tmp_path):
    """Issue 27, class 4: `kill -TERM` on a running `qkmla train` (as Slurm, Kubernetes and docker
    stop do): status "stopped" at the step it finished, checkpointed, the lock released, no
    traceback; resumed in another process, its losses equal an uninterrupted run's (one thread:
    deterministic arithmetic, the case the resume guarantee in docs/training.md covers)."""
    import signal

    args = ["--preset", "debug", "--batch-size", "4", "--block-size", "16", "--eval-interval", "50",
            "--eval-iters", "1", "--ckpt-interval", "1000", "--steps", "400", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = lambda out, *extra: subprocess.run([sys.executable, "-m", "qkmla", "train", *args, "--out", str(out), *extra],
                                             capture_output=True, text=True, env=env, timeout=600)
    assert run(tmp_path / "full").returncode == 0
    p = subprocess.Popen([sys.executable, "-m", "qkmla", "train", *args, "--out", str(tmp_path / "part")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _wait_for_steps(tmp_path / "part", 5)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143 and "Traceback" not in err, err  # 128 + SIGTERM, as a shell reports it
    status = json.loads((tmp_path / "part" / "status.json").read_text())
    assert status["status"] == "stopped" and 5 <= status["step"] < 400, status
    assert status["checkpoint_step"] == status["step"] and not (tmp_path / "part" / "lock").exists()
    assert len(read(tmp_path / "part")) == status["step"]
    assert run(tmp_path / "part", "--resume").returncode == 0
    assert [r["loss"] for r in read(tmp_path / "part")] == [r["loss"] for r in read(tmp_path / "full")]


def test_a_resume_killed_before_its_first_checkpoint_leaves_a_run_the_next_resume_takes(tmp_path):
    """A resume with another lr, SIGKILLed before it checkpoints, has written its settings to
    config.json (neither the checkpoint's record nor what the next resume asks for): the next
    resume, with a third lr, goes on; only a hand edit of the file is refused (issue 56)."""
    import signal
    import time

    run = tmp_path / "run"
    args = ["--preset", "debug", "--batch-size", "4", "--block-size", "16", "--eval-iters", "1", "--no-progress",
            "--out", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def qkmla(*extra, **kw):
        return subprocess.run([sys.executable, "-m", "qkmla", "train", *args, *extra], capture_output=True, text=True,
                              env=env, timeout=600, **kw)

    assert qkmla("--steps", "2", "--lr", "0.001").returncode == 0
    p = subprocess.Popen([sys.executable, "-m", "qkmla", "train", *args, "--resume", "--steps", "100000", "--lr",
                          "0.002", "--ckpt-interval", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    deadline = time.time() + 120
    while time.time() < deadline and '"lr": 0.002' not in (run / "config.json").read_text():
        time.sleep(0.05)
    while time.time() < deadline and json.loads((run / "status.json").read_text())["status"] != "running":
        time.sleep(0.05)
    assert '"lr": 0.002' in (run / "config.json").read_text()  # the killed resume wrote its settings
    assert json.loads((run / "status.json").read_text())["status"] == "running"
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    resumed = qkmla("--resume", "--steps", "4", "--lr", "0.003")
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run / "config.json").read_text())["train"]["lr"] == 0.003
    (run / "config.json").write_text((run / "config.json").read_text().replace('"seed": 1337', '"seed": 7'))
    edited = qkmla("--resume", "--steps", "6")
    assert edited.returncode == 2 and "was changed since the run wrote it (train.seed: 7 in the file" in edited.stderr


def test_train_shuts_down_the_process_group_it_started(tmp_path):
    """Issue 27, class 4: under torchrun's environment (two ranks started by hand here), train()
    ends with the process group destroyed on every rank, so nothing is left to fail at exit."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = ("import json, torch.distributed as dist; from qkmla.train.trainer import TrainConfig, train; "
            f"s = train(TrainConfig(preset='debug', batch_size=4, block_size=16, steps=2, eval_iters=1, progress=False, "
            f"out={str(tmp_path / 'run')!r})); print(json.dumps([s['status'], dist.is_initialized()]))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1]) == ["done", False]


def _wait_for_steps(run, steps: int, timeout: float = 120) -> None:
    """Until the run in ``run`` (a subprocess's) has logged ``steps`` steps, or ``timeout`` seconds."""
    import time

    metrics, deadline = run / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < steps):
        time.sleep(0.05)


def test_a_sigterm_its_starter_ignored_stays_ignored(tmp_path):
    """`trap '' TERM; qkmla train ...` (or a supervisor that ignores SIGTERM for its children): the
    trainer took SIGTERM over and stopped on it; now it trains on, as Python's default would."""
    import signal

    args = ["--preset", "debug", "--batch-size", "2", "--block-size", "16", "--eval-interval", "50",
            "--eval-iters", "1", "--steps", "40", "--no-progress", "--out", str(tmp_path / "run")]
    p = subprocess.Popen([sys.executable, "-m", "qkmla", "train", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    _wait_for_steps(tmp_path / "run", 3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert json.loads((tmp_path / "run" / "status.json").read_text())["status"] == "done"
