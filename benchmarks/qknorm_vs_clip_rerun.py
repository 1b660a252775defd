"""Rerun the first steps of committed ``qknorm-vs-clip`` runs at several commits and compare
their per-step losses and max logits with each other and with the committed metrics: the
grid's runs were trained at 1d131a5, 761ae43 and e78c8b1, whose training code differs in its
text (trainer.py, data.py, norms.py, mla.py changed between them), so whether they train the
same steps is measured here, not assumed.

    python -m benchmarks.qknorm_vs_clip_rerun --commits 1d131a5 761ae43 e78c8b1 \\
        --out benchmarks/results/experiments/qknorm-vs-clip/rerun_commits.json

Each commit is checked out with ``git worktree add --detach`` under ``--worktrees`` (HEAD is
this checkout) and trains each run's committed config (the commits side by side, one process each), with ``steps`` cut to the given number
and the ``constant`` schedule (before step 480 the 600-step WSD schedule is the constant one,
warmup included, so the learning rates are the committed run's), in a fresh process with one
thread, as the grid's workers ran.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from qkmla.train.plot import read_metrics
from qkmla.utils.files import write_text
from qkmla.utils.machine import machine, source_commit

from .common import ROOT

GRID = ROOT / "benchmarks" / "results" / "experiments" / "qknorm-vs-clip"
# Seed 3's runs by default (its QK-Clip tau = 17 run clips first, at step 154, the earliest of the seven).
RUNS = {"mla_lr0.005_s3": 30, "mla-qknorm_lr0.005_s3": 30, "mla-qkclip-transient_lr0.005_s3": 160}


def run_steps(text: str) -> tuple[str, int]:
    """An argparse type: ``RUN:STEPS``, a committed run's name and how many of its first steps to rerun."""
    name, _, steps = text.partition(":")
    if not (GRID / "runs" / name / "config.json").is_file() or not steps.isdigit() or int(steps) < 1:
        raise argparse.ArgumentTypeError(f"expected RUN:STEPS with RUN a committed qknorm-vs-clip run, got {text!r}")
    return name, int(steps)

CHILD = r"""
import dataclasses, json, sys, torch
torch.set_num_threads(1)
from qkmla.train.trainer import TrainConfig, train
from qkmla.train.plot import read_metrics
cfg, out, steps = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
names = {f.name for f in dataclasses.fields(TrainConfig)}
cfg = {k: v for k, v in cfg.items() if k in names}
cfg.update(steps=steps, schedule="constant", out=out, resume=False, overwrite=True, progress=False,
           ckpt_interval=10**6, eval_interval=10**6)
status = train(TrainConfig(**cfg))
rows = read_metrics(out)
print(json.dumps({"status": status["status"], "loss": [r["loss"] for r in rows],
                  "max_logit": [r["max_logit"] for r in rows], "clipped_heads": [r.get("clipped_heads") for r in rows],
                  "lr": [r["lr"] for r in rows]}))
"""


def _checkout(commit: str, worktrees: Path) -> Path:
    if commit == "HEAD":
        return ROOT
    path = worktrees / f"qkrerun-{commit}"
    if not path.is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True,
                       capture_output=True)
    return path


def rerun(commit: str, worktrees: Path, run: str, steps: int) -> dict:
    tree = _checkout(commit, worktrees)
    cfg = json.loads((GRID / "runs" / run / "config.json").read_text())["train"]
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg), str(Path(tmp) / "run"), str(steps)],
                             env=env, cwd=str(tree), check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["source_commit"] = source_commit(tree / "src")
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", nargs="+", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--worktrees", type=Path, default=Path("/tmp"))
    parser.add_argument("--runs", type=run_steps, nargs="+", default=list(RUNS.items()),
                        help="RUN:STEPS pairs (default: %(default)s)")
    args = parser.parse_args(argv)
    runs = dict(args.runs)
    result = {"command": "python -m benchmarks.qknorm_vs_clip_rerun " + " ".join(sys.argv[1:] if argv is None else argv),
              "commit": source_commit(ROOT), "machine": machine(), "runs": {}}
    for c in args.commits:
        _checkout(c, args.worktrees)
    with concurrent.futures.ThreadPoolExecutor(len(args.commits)) as pool:  # one process per commit at a time
        reruns = {c: pool.submit(lambda c: {run: rerun(c, args.worktrees, run, steps) for run, steps in runs.items()}, c)
                  for c in args.commits}
        reruns = {c: f.result() for c, f in reruns.items()}
    for run, steps in runs.items():
        committed = [r for r in read_metrics(GRID / "runs" / run) if r["step"] <= steps]
        entry = {"steps": steps, "committed": {"loss": [r["loss"] for r in committed],
                                               "max_logit": [r["max_logit"] for r in committed]}, "commits": {}}
        for c in args.commits:
            got = reruns[c][run]
            entry["commits"][c] = {
                "source_commit": got["source_commit"], "status": got["status"],
                "loss_equal_to_committed": got["loss"] == entry["committed"]["loss"],
                "max_logit_equal_to_committed": got["max_logit"] == entry["committed"]["max_logit"],
                "max_abs_loss_difference": max(abs(a - b) for a, b in zip(got["loss"], entry["committed"]["loss"])),
                "clipped_steps": sum(1 for h in got["clipped_heads"] if h), "loss": got["loss"]}
            print(run, c, entry["commits"][c]["loss_equal_to_committed"],
                  entry["commits"][c]["max_abs_loss_difference"], flush=True)
        result["runs"][run] = entry
    result["all_equal"] = all(e["loss_equal_to_committed"] and e["max_logit_equal_to_committed"]
                              for r in result["runs"].values() for e in r["commits"].values())
    write_text(args.out, json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
