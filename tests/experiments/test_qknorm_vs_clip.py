"""qknorm-vs-clip: the rate bracket, the transient threshold, paired statistics, the QK-Clip
runs that repeat plain MLA, and the adaptive grid end to end at its --quick size."""

import json
import math

import pytest

from qkmla.experiments import EXPERIMENTS, Options, run_experiment
from qkmla.experiments.qknorm_vs_clip.design import LR_GRID, TRANSIENT, VARIANTS, choose_rate, transient_tau
from qkmla.experiments.results import paired_difference, spikes
from qkmla.train.trainer import TrainConfig, train


def test_choose_rate_extends_a_bracket_whose_best_is_at_an_end():
    assert choose_rate({5e-3: 2.0, 1e-2: 1.9, 2e-2: 1.95}, 2) == (1e-2, None)
    assert choose_rate({5e-3: 2.0, 1e-2: 1.9, 2e-2: 1.85}, 2) == (None, 4e-2)
    assert choose_rate({5e-3: 1.8, 1e-2: 1.9, 2e-2: 1.95}, 2) == (None, 2.5e-3)
    assert choose_rate({5e-3: 1.8, 1e-2: 1.9, 2e-2: 1.95}, 0) == (5e-3, None)  # no extensions left
    assert choose_rate({5e-3: 2.0, 1e-2: None}, 2) == (None, None)  # not finished
    assert choose_rate({LR_GRID[-2]: 2.0, LR_GRID[-1]: 1.9}, 2) == (LR_GRID[-1], None)  # the grid's end


def test_transient_tau_lies_below_the_peak():
    assert transient_tau(50.0, 30.0) == 40.0  # halfway from the late level to the peak
    assert transient_tau(50.0, 49.0) == 40.0  # at most 0.8 of the peak
    assert transient_tau(43.7, 20.0) == 32.0  # two significant figures


def test_paired_difference():
    p = paired_difference([0.0120, 0.0126, 0.0163])
    assert p["n"] == 3 and (p["positive"], p["negative"]) == (3, 0)
    assert p["mean"] == pytest.approx(0.013633, abs=1e-6) and p["t"] == pytest.approx(10.2, abs=0.1)
    assert p["detectable"] == pytest.approx((4.303 + 1.061) * p["se"])
    assert paired_difference([0.5])["se"] is None


def test_spikes():
    losses = [(i, 2.0 - 0.001 * i) for i in range(1, 120)]
    losses[80] = (81, 2.9)
    assert spikes(losses) == [81]
    assert spikes(losses, nats=1.0) == []


def test_qk_clip_that_never_fires_is_plain_mla_step_for_step(tmp_path):
    """Why a QK-Clip run whose plain twin stayed under tau need not be trained."""
    fast = dict(preset="debug", batch_size=4, block_size=16, steps=6, warmup_steps=1, eval_interval=3, eval_iters=2,
                progress=False, attn="mla", optimizer="muon", lr=2e-2)
    train(TrainConfig(**fast, out=str(tmp_path / "plain")))
    train(TrainConfig(**fast, qk_clip=100.0, out=str(tmp_path / "clip")))
    read = lambda d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    plain, clip = read("plain"), read("clip")
    assert max(r["max_logit"] for r in plain) < 100 and all(r["clipped_heads"] == 0 for r in clip)
    for key in ("loss", "grad_norm", "max_logit", "val_loss"):
        assert [r.get(key) for r in plain] == [r.get(key) for r in clip]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("qknorm-vs-clip")
    options = Options(out, quick=True, workers=2)
    run_experiment(EXPERIMENTS["qknorm-vs-clip"], options, progress=False, command="test")
    return options


def _rows(options):
    return [json.loads(x) for x in (options.out / "results.jsonl").read_text().splitlines()]


def test_quick_grid_runs_every_stage(quick):
    rows = _rows(quick)
    assert [r["stage"] for r in rows[:2 * len(VARIANTS)]] == ["bracket"] * 2 * len(VARIANTS)
    assert rows[0]["variant"] == "mla" and rows[0]["seed"] == 0
    stages = {(r["variant"], r["stage"]) for r in rows}
    assert all((v, s) in stages for v in VARIANTS for s in ("bracket", "seed", "stress"))
    for r in rows:
        assert r["status"] in ("done", "non-finite")
        if r["status"] == "done":
            assert 0 < r["test_loss"] < r["initial_loss"] + 1 and 0 <= r["last_word_accuracy"] <= 1
            assert r["val_tokens"] == r["test_tokens"] == 4095 and r["commit"]
    stress = [r for r in rows if r["stage"] == "stress"]
    assert all(r["grad_clip"] == 0 and r["lr"] == pytest.approx(10 * r["chosen_lr"]) for r in stress)
    # tau = 100 is far above these tiny models' logits: every such run is its plain twin's
    clip100 = [r for r in rows if r["variant"] == "mla-qkclip-100"]
    assert clip100 and all(r["same_as"] == r["run"].replace("mla-qkclip-100", "mla") for r in clip100)
    transient = [r for r in rows if r["variant"] == TRANSIENT]
    plain0 = next(r for r in rows if r["variant"] == "mla" and r["stage"] == "bracket"
                  and r["lr"] == transient[0]["lr"])
    assert all(r["tau"] == transient[0]["tau"] < plain0["peak_max_logit"] for r in transient)
    assert any(r.get("clipped_steps") for r in transient)
    summary = json.loads((quick.out / "summary.json").read_text())
    assert summary["paired"]["mla-qknorm - mla"]["test_loss"]["n"] == 2 and summary["commit"]
    assert set(summary["chosen_lr"]) == set(VARIANTS) and math.isfinite(summary["design"]["tokens_per_param"])
    for name in ("curves.png", "brackets.png", "stress.png"):
        assert (quick.out / name).read_bytes()[:4] == b"\x89PNG"
    assert summary["figures"] == ["curves.png", "brackets.png", "stress.png"]  # what plot must not replace


def test_quick_grid_resumes_run_by_run(quick):
    again = json.loads(json.dumps(run_experiment(EXPERIMENTS["qknorm-vs-clip"], quick, progress=False).summary))
    assert json.loads((quick.out / "summary.json").read_text())["runs_trained_now"] == 0
    assert again["chosen_lr"] == json.loads((quick.out / "summary.json").read_text())["chosen_lr"]
    # A run killed before it finished (no final status) is the only one trained again.
    victim = next(r for r in _rows(quick) if r["stage"] == "seed" and not r.get("same_as"))
    (quick.out / "runs" / victim["run"] / "status.json").unlink()
    run_experiment(EXPERIMENTS["qknorm-vs-clip"], quick, progress=False)
    assert json.loads((quick.out / "summary.json").read_text())["runs_trained_now"] == 1


def test_redraw_publishes_a_copy_of_the_results(quick, tmp_path):
    from qkmla.experiments.base import redraw

    report = redraw(EXPERIMENTS["qknorm-vs-clip"], quick.out, tmp_path / "copy", quick=True)
    assert (tmp_path / "copy" / "results.jsonl").read_text() == (quick.out / "results.jsonl").read_text()
    summary = json.loads((tmp_path / "copy" / "summary.json").read_text())
    source = json.loads((quick.out / "summary.json").read_text())
    assert summary["command"] == source["command"] and summary["chosen_lr"] == report.summary["chosen_lr"]
    assert (tmp_path / "copy" / "curves.png").is_file() and summary["figures"] == source["figures"]
    # A bracket that is not finished chooses nothing yet.
    from qkmla.experiments.qknorm_vs_clip.report import _chosen_from_rows

    rows = _rows(quick)
    first = next(r for r in rows if r["variant"] == "mla-qknorm" and r["stage"] == "bracket")
    assert "mla-qknorm" not in _chosen_from_rows([{**r, "status": "running", "val_loss_all": None}
                                                   if r is first else r for r in rows], quick=True)
