"""qknorm-confirm: every arm of a seed starts from the same weights and batches, a branched
warmup-stable-decay run trains the steps of one straight run, the plan's order and
branching, fixed-n reporting and the archived metrics."""

import json
from pathlib import Path

import pytest
import torch

from qkmla.experiments import EXPERIMENTS, Options
from qkmla.experiments.grid import Run, _train_one, start_branch
from qkmla.experiments.numerics import GRID_THREADS, SUPERSEDED, numerics, record, recorded
from qkmla.experiments.qknorm_confirm.design import (
    ARMS,
    HORIZONS,
    LR,
    PRIMARY_HORIZON,
    QUICK,
    SEEDS,
    all_runs,
    branch_point,
    plan,
    settings,
    thin_metrics,
)
from qkmla.experiments.qknorm_confirm.report import report
from qkmla.experiments.results import paired_family, summarize
from qkmla.model.gpt import GPT
from qkmla.train.trainer import TrainConfig

DATA_FIELDS = ("data", "split", "tokenizer", "batch_size", "block_size", "seed", "preset", "model_overrides", "lr",
               "optimizer", "warmup_steps", "schedule", "steps", "grad_clip")


def test_arms_start_from_identical_weights_and_batches():
    """The grid's seed 1000 at full size: the shared tensors are equal; QK-norm's extra gains start at 1."""
    options = Options(Path("unused"))
    fields = {a: settings(options, a, LR, SEEDS[0], 480, "constant") for a in ARMS}
    assert len({json.dumps({k: f.get(k) for k in DATA_FIELDS}, sort_keys=True) for f in fields.values()}) == 1
    states = {}
    for arm, f in fields.items():
        cfg = TrainConfig(**f)
        torch.manual_seed(cfg.seed)  # as the trainer builds the model
        states[arm] = {k: v.detach() for k, v in GPT(cfg.model_config(84)).named_parameters()}
    plain = states["mla"]
    for arm, state in states.items():
        assert set(plain) <= set(state), arm
        for k in plain:
            assert torch.equal(plain[k], state[k]), (arm, k)
        extra = set(state) - set(plain)
        assert bool(extra) == (arm == "mla-qknorm"), arm
        assert all(torch.equal(state[k], torch.ones_like(state[k])) for k in extra), arm


def _losses(path: Path) -> list:
    return [(r["step"], r["loss"], r["max_logit"]) for r in map(json.loads, (path / "metrics.jsonl").read_text()
                                                                  .splitlines())]


@pytest.mark.parametrize("arm", ["mla", "mla-qkclip-17"])
def test_a_branched_run_trains_the_steps_of_one_straight_run(tmp_path, arm):
    """Stable to 4, stable to 8 from it, decay to 10 from that: the steps of one 10-step WSD run."""
    tiny = lambda steps, schedule: {**settings(Options(tmp_path, quick=True), arm, 2e-2, 3, steps, schedule),
                                    "qk_clip": 0.05 if arm != "mla" else None}  # a clip that fires in 10 steps
    straight = _train_one(tiny(10, "wsd"), str(tmp_path / "straight"), None)
    assert straight["status"] == "done"
    assert _train_one(tiny(4, "constant"), str(tmp_path / "s4"), None)["status"] == "done"
    assert _train_one(tiny(8, "constant"), str(tmp_path / "s8"), None, str(tmp_path / "s4"))["status"] == "done"
    assert _train_one(tiny(10, "wsd"), str(tmp_path / "h10"), None, str(tmp_path / "s8"))["status"] == "done"
    assert [s for s, _, _ in _losses(tmp_path / "h10")] == list(range(1, 11))
    assert _losses(tmp_path / "h10") == _losses(tmp_path / "straight")
    assert recorded(tmp_path / "h10") == recorded(tmp_path / "s4") == numerics()  # one trajectory, one numerics
    lrs = [json.loads(x)["lr"] for x in (tmp_path / "h10" / "metrics.jsonl").read_text().splitlines()]
    point = branch_point(10)
    assert lrs[point - 1] == lrs[point] > lrs[-1] > 0  # constant to the branch point, then decaying
    if arm != "mla":
        assert any(json.loads(x).get("clipped_heads") for x in (tmp_path / "h10" / "metrics.jsonl").read_text()
                   .splitlines())
    # resuming a finished branch trains nothing; an unfinished parent is refused
    assert _train_one(tiny(10, "wsd"), str(tmp_path / "h10"), None, str(tmp_path / "s8"))["status"] == "done"
    with pytest.raises(ValueError, match="start_from"):
        start_branch(tmp_path / "missing", tmp_path / "x")


def test_the_plan_lists_a_branch_once_its_run_is_finished_and_orders_seed_by_seed(tmp_path):
    options = Options(tmp_path)
    runs = all_runs(options)
    names = [r.name for r in runs]
    assert len(names) == len(set(names))
    assert [r.labels["stage"] for r in runs[:6]] == ["reproduce"] * 6 and runs[0].labels["seed"] == 0
    main = [r for r in runs if r.labels["stage"] == "main"]
    assert [r.labels["seed"] for r in main] == sorted(r.labels["seed"] for r in main)  # seed-major
    assert len(main) == len(SEEDS) * len(ARMS) * 6
    first_rate = names.index(next(r.name for r in runs if r.labels["stage"] == "rate check"))
    assert runs[first_rate - 1].labels["seed"] == SEEDS[3] and runs[-1].labels["stage"] == "reproduce"
    chain = [r for r in main if r.variant == "mla" and r.labels["seed"] == SEEDS[0]]
    assert [(r.train["steps"], r.train["schedule"]) for r in chain] == [
        (480, "constant"), (600, "wsd"), (960, "constant"), (1200, "wsd"), (1920, "constant"), (2400, "wsd")]
    assert [r.start_from for r in chain] == [None] + [chain[i].name for i in (0, 0, 2, 2, 4)]
    assert all(r.start_from is None for r in plan(options))  # nothing finished: only first stretches
    assert EXPERIMENTS["qknorm-confirm"].plan is plan


def _row(arm, seed, horizon, loss):
    return {"variant": arm, "seed": seed, "horizon": horizon, "stage": "main", "phase": "decay", "status": "done",
            "run": f"{arm}_{seed}_{horizon}", "lr": LR, "val_loss_all": loss, "test_loss": loss, "test_accuracy": 0.5}


def test_no_test_until_every_seed_is_in(tmp_path):
    seeds = QUICK["seeds"]
    h = QUICK["horizons"][-1]
    rows = [_row(a, s, h, 1.0 + 0.01 * i + 0.001 * s + 0.0003 * (i * s % 7)) for i, a in enumerate(ARMS) for s in seeds]
    s = report(rows, Options(tmp_path, quick=True)).summary
    assert s["primary"]["status"] == "complete" and s["primary"]["metric"] == "val_loss_all"
    assert set(s["primary"]["tests"]) == {f"mla-qknorm - {b}" for b in ARMS if b != "mla-qknorm"}
    assert all(0 <= t["p"] <= t["holm_p"] <= 1 for t in s["primary"]["tests"].values())
    assert s["runs_in_all"] == len(seeds) * len(ARMS) * 2 * len(QUICK["horizons"])  # a stable stretch and a decay
    # The full grid: 12 seeds x 4 arms x 3 horizons, the rate check's 8 chains and the reproduction's 21
    # branches, each horizon a stable stretch and a decay.
    assert report([], Options(tmp_path)).summary["runs_in_all"] == 2 * (12 * 4 * 3 + 8 * 3 + 21) == 378
    partial = report(rows[1:], Options(tmp_path, quick=True)).summary["primary"]
    assert partial["status"] == "pending" and partial["seeds_in"]["mla-qknorm - mla"] == len(seeds) - 1
    assert paired_family({}, (("a", "b"),), "test_loss", (1, 2))["status"] == "pending"
    # --quick has no test or held-out plays: no family of theirs, and its tables name the validation loss
    assert not any(k.startswith(("test_accuracy", "heldout")) for k in s["secondary"])
    table = report(rows, Options(tmp_path, quick=True)).table
    assert "| arm | seeds | validation loss |" in table and "Primary (validation loss" in table
    means = table.split("Primary")[0]
    assert "test loss" not in table and "| – |" not in means
    # The full grid's families, at its own seeds and horizons
    full_rows = [_row(a, s, PRIMARY_HORIZON, 1.0 + 0.01 * i + 0.001 * s + 0.0003 * (i * s % 7))
                 for i, a in enumerate(ARMS) for s in SEEDS]
    full = report(full_rows, Options(tmp_path))
    assert full.summary["primary"]["status"] == "complete" and full.summary["primary"]["metric"] == "test_loss"
    assert "| arm | seeds | test loss | loss, all four held-out plays | next-char accuracy |" in full.table
    same = full.summary["secondary"][f"test_accuracy at {HORIZONS[0]}, mla-qkclip-17 - mla"]
    assert same["status"] == "pending"  # no rows at the first horizon
    acc = full.summary["secondary"][f"test_accuracy at {PRIMARY_HORIZON}"]["tests"]["mla-qknorm - mla"]
    assert acc["degenerate"] and "p" not in acc and "holm_p" not in acc  # 0.5 in every row


def test_archived_metrics_keep_what_the_results_rows_read(tmp_path):
    arm = "mla-qkclip-17"
    f = {**settings(Options(tmp_path, quick=True), arm, 2e-2, 3, 12, "wsd"), "qk_clip": 0.05}
    assert _train_one(f, str(tmp_path / "runs" / "r"), None)["status"] == "done"
    rows = [json.loads(x) for x in (tmp_path / "runs" / "r" / "metrics.jsonl").read_text().splitlines()]
    thin = thin_metrics(rows)
    assert len(thin) == len(rows) and any(len(t) < len(r) for t, r in zip(thin, rows))
    run = Run("r", arm, f)
    full = summarize("qknorm-confirm", run, tmp_path)
    (tmp_path / "runs" / "r" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in thin))
    assert summarize("qknorm-confirm", run, tmp_path) == full


def test_a_finished_run_without_its_checkpoint_trains_again_when_a_branch_needs_it(tmp_path):
    """Runs restored from the committed archive have no checkpoint: a branch cannot start from them."""
    options = Options(tmp_path, quick=True)
    first, second = all_runs(options)[:2]  # a first stable stretch and its decay branch
    path = tmp_path / "runs" / first.name
    path.mkdir(parents=True)
    (path / "status.json").write_text(json.dumps({"status": "done"}))
    (path / "config.json").write_text(json.dumps({"train": first.train}))
    assert second.start_from == first.name and second.name not in {r.name for r in plan(options)}
    assert not (path / "status.json").exists() and (path / "status.no-checkpoint.json").is_file()


def test_a_chain_restored_from_other_numerics_trains_again_whole_and_its_old_runs_are_kept(tmp_path):
    """The archive restored on a machine whose CPU rounds differently: the stable stretch an
    unfinished branch needs has no checkpoint, and trained again here it would be another run, so
    the plan supersedes it and the branch already taken from it, and lists the stretch again."""
    options = Options(tmp_path, quick=True)
    first, second = all_runs(options)[:2]
    elsewhere = {**numerics(GRID_THREADS), "cpu_capability": "elsewhere"}
    for run in (first, second):
        path = tmp_path / "runs" / run.name
        path.mkdir(parents=True)
        (path / "status.json").write_text(json.dumps({"status": "done"}))
        (path / "config.json").write_text(json.dumps({"train": run.train}))
        (path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
        record(path, elsewhere)
    planned = {r.name for r in plan(options)}
    assert first.name in planned and second.name not in planned
    assert not (tmp_path / "runs" / first.name).exists() and not (tmp_path / "runs" / second.name).exists()
    assert {p.name for p in (tmp_path / SUPERSEDED).iterdir()} == {first.name, second.name}
    rows = [summarize("qknorm-confirm", r, tmp_path) for r in all_runs(options)]
    summary = report(rows, options).summary
    assert [s["run"] for s in summary["superseded"]] == sorted([first.name, second.name])
