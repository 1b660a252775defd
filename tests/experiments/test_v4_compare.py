"""v4-compare: the arms cache the same values per token with parameters within 2% (the widths
the protocol states), a seed gives every arm the same batches and the same shared initial
tensors, the seeds are fresh, the plan's order, fixed-n reporting, and a quick end-to-end run."""

import json
from pathlib import Path

import torch

from qkmla.experiments import EXPERIMENTS, Options, run_experiment
from qkmla.experiments.grid import _train_one
from qkmla.experiments.qknorm_confirm.design import SEEDS as CONFIRM_SEEDS
from qkmla.experiments.v4_compare.design import (
    ARMS,
    BRACKET,
    CACHE_VALUES_PER_TOKEN,
    PAIRS,
    PARAMS,
    QUICK,
    SEEDS,
    TUNING_SEEDS,
    arm_model,
    plan,
    settings,
)
from qkmla.experiments.v4_compare.report import report
from qkmla.train import trainer

DATA_FIELDS = ("data", "split", "tokenizer", "batch_size", "block_size", "seed", "preset", "steps", "optimizer",
               "warmup_steps", "schedule", "grad_clip")
COMMITTED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "experiments"


def test_equal_cache_values_per_token_and_parameters_within_two_percent():
    """The widths docs/results.md states: plain MLA d_c 128 + d_r 20; QK-normed MLA d_c 125 + d_r 20
    + 3 key scalars; v4 one vector of 148 (20 rotated), query LoRA 48, sinks."""
    models = {a: arm_model(Options(Path("unused")), a, SEEDS[0]) for a in ARMS}
    counts = {a: m.num_params() for a, m in models.items()}
    assert counts == PARAMS
    assert max(counts.values()) / min(counts.values()) - 1 < 0.02
    for arm, m in models.items():
        per_layer = [c.bytes_per_token for c in m.make_caches(1, 1)]
        assert per_layer == [4 * CACHE_VALUES_PER_TOKEN] * 4, arm  # float32, each of the 4 layers
        bf16 = [c.bytes_per_token for c in m.make_caches(1, 1, dtype=torch.bfloat16)]
        assert bf16 == [2 * CACHE_VALUES_PER_TOKEN] * 4, arm  # QK-norm's scalars in bf16 too: 296 bytes
    v4, qk, plain = (models[a].blocks[0].attn.config for a in ("v4", "mla-qknorm", "mla"))
    assert (v4.head_dim, v4.rope_head_dim, v4.q_lora_rank, v4.attention_sinks, v4.num_heads) == (148, 20, 48, True, 3)
    assert (qk.kv_lora_rank, qk.qk_rope_head_dim, qk.num_key_scalars) == (125, 20, 3)
    assert (plain.kv_lora_rank, plain.qk_rope_head_dim, plain.num_key_scalars, plain.q_lora_rank) == (128, 20, 0, None)


def test_arms_of_a_seed_share_their_batches_and_initial_tensors(tmp_path, monkeypatch):
    options = Options(tmp_path)
    fields = {a: settings(options, a, BRACKET[1], SEEDS[0]) for a in ARMS}
    assert len({json.dumps({k: f.get(k) for k in DATA_FIELDS}, sort_keys=True) for f in fields.values()}) == 1
    states = {a: dict(arm_model(options, a, SEEDS[0]).named_parameters()) for a in ARMS}
    for a in ARMS:
        for b in ARMS:
            shared = [k for k in states[a] if k in states[b] and states[a][k].shape == states[b][k].shape]
            assert {"wte.weight", "blocks.3.mlp.up.weight", "blocks.3.mlp.down.weight", "ln_f.weight"} <= set(shared)
            assert all(torch.equal(states[a][k], states[b][k]) for k in shared), (a, b)
    # the batches each arm trains on, as the trainer draws them (quick size, 3 steps)
    seen: dict = {}
    draw = trainer.get_batch

    def recording(*args, **kwargs):
        x, y = draw(*args, **kwargs)
        seen.setdefault(arm, []).append(x.clone())
        return x, y

    monkeypatch.setattr(trainer, "get_batch", recording)
    for arm in ARMS:
        f = {**settings(Options(tmp_path, quick=True), arm, 1e-2, SEEDS[0]), "steps": 3}
        assert _train_one(f, str(tmp_path / arm), None)["status"] == "done"
    assert all(len(v) == 3 for v in seen.values())
    assert all(torch.equal(x, y) for arm in ARMS for x, y in zip(seen[arm], seen["mla"]))


def test_the_seeds_are_fresh():
    # Every other experiment's committed seeds: v4-compare's own results reuse its seeds by design.
    used = {r.get("seed") for path in COMMITTED.glob("*/results.jsonl") if path.parent.name != "v4-compare"
            for r in map(json.loads, path.read_text().splitlines())}
    used |= set(CONFIRM_SEEDS)
    assert used and not (set(SEEDS) | set(TUNING_SEEDS)) & used
    assert not set(SEEDS) & set(TUNING_SEEDS) and len(SEEDS) >= 5


def test_the_plan_brackets_every_arm_first(tmp_path):
    runs = plan(Options(tmp_path))
    assert len(runs) == len(ARMS) * len(BRACKET) * len(TUNING_SEEDS)  # nothing finished: no main run yet
    assert {r.labels["stage"] for r in runs} == {"bracket"} and len({r.name for r in runs}) == len(runs)
    assert {(r.variant, r.labels["lr"], r.labels["seed"]) for r in runs} == \
        {(a, lr, s) for a in ARMS for lr in BRACKET for s in TUNING_SEEDS}
    assert EXPERIMENTS["v4-compare"].plan is plan


def _row(arm, seed, loss, stage="main"):
    return {"variant": arm, "seed": seed, "stage": stage, "status": "done", "run": f"{arm}_{seed}", "lr": 5e-3,
            "val_loss_all": loss, "test_loss": loss + 0.01, "test_accuracy": 0.5, "heldout_loss_pooled": loss,
            "params": PARAMS[arm], "cache_bytes_per_token": 4 * 4 * CACHE_VALUES_PER_TOKEN}


def test_no_test_until_every_seed_is_in(tmp_path):
    rows = [_row(a, s, 1.0 + 0.01 * i + 0.001 * s + 0.0003 * (i * s % 7)) for i, a in enumerate(ARMS) for s in SEEDS]
    rows += [_row(a, s, 1.1 - 0.01 * k, "bracket") | {"lr": lr} for a in ARMS for k, lr in enumerate(BRACKET)
             for s in TUNING_SEEDS]
    s = report(rows, Options(tmp_path)).summary
    assert s["primary"]["status"] == "complete" and s["primary"]["metric"] == "test_loss"
    assert set(s["primary"]["tests"]) == {f"{a} - {b}" for a, b in PAIRS}
    assert all(0 <= t["p"] <= t["holm_p"] <= 1 and t["n"] == len(SEEDS) for t in s["primary"]["tests"].values())
    assert s["chosen_lr"] == {a: BRACKET[-1] for a in ARMS}
    partial = report(rows[1:], Options(tmp_path)).summary["primary"]
    assert partial["status"] == "pending" and partial["seeds_in"]["v4 - mla-qknorm"] == len(SEEDS) - 1


def test_quick_end_to_end(tmp_path):
    out = tmp_path / "v4"
    run_experiment(EXPERIMENTS["v4-compare"], Options(out, quick=True, workers=1), progress=False,
                   command="qkmla experiment v4-compare --quick")
    rows = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == len(ARMS) * (len(QUICK["tuning_seeds"]) + len(QUICK["seeds"]))
    assert all(r["status"] == "done" and r["val_loss_all"] > 0 for r in rows)
    assert {r["cache_bytes_per_token"] for r in rows} == {2 * 4 * 36}  # debug preset: 2 layers of 36 values
    summary = json.loads((out / "summary.json").read_text())
    assert summary["errors"] == [] and summary["primary"]["status"] == "complete"
    assert summary["chosen_lr"] == {a: QUICK["bracket"][0] for a in ARMS}
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


def test_a_best_rate_at_an_end_adds_the_next_rate_once_then_the_main_seeds_follow(tmp_path, monkeypatch):
    from qkmla.experiments.v4_compare import design

    options = Options(tmp_path)
    losses = {"v4": {2.5e-3: 1.3, 5e-3: 1.2, 1e-2: 1.1, 2e-2: 1.0}, "mla-qknorm": {2.5e-3: 1.2, 5e-3: 1.1, 1e-2: 1.3},
              "mla": {1.25e-3: 1.4, 2.5e-3: 1.0, 5e-3: 1.1, 1e-2: 1.2}}
    finished = set()  # (arm, lr) whose runs on both tuning seeds are scored

    def score(options, runs):
        arm, lr = runs[0].variant, runs[0].labels["lr"]
        return losses[arm][lr] if (arm, lr) in finished else None

    monkeypatch.setattr(design, "_score", score)
    finished |= {(a, lr) for a in ARMS for lr in BRACKET}
    runs = plan(options)
    extra = {(r.variant, r.labels["lr"]) for r in runs} - finished
    assert extra == {("v4", 2e-2), ("mla", 1.25e-3)} and {r.labels["stage"] for r in runs} == {"bracket"}
    finished |= extra  # v4's 2e-2 is best again, at the new end: no second extension
    runs = plan(options)
    assert design.chosen_rates(options)[1] == {"v4": 2e-2, "mla-qknorm": 5e-3, "mla": 2.5e-3}
    main = [r for r in runs if r.labels["stage"] == "main"]
    assert [(r.labels["seed"], r.variant) for r in main] == [(s, a) for s in SEEDS for a in ARMS]
    assert all(r.labels["lr"] == {"v4": 2e-2, "mla-qknorm": 5e-3, "mla": 2.5e-3}[r.variant] for r in main)
