import json

from qkmla.cli import demo
from qkmla.cli.demo import run_demo


def test_demo_end_to_end_small(tmp_path, capsys):
    """The main job on the debug preset with few steps: every stage runs and is reported."""
    assert run_demo(out=str(tmp_path), steps=20, preset="debug") == 0
    out = capsys.readouterr().out
    for text in ("training 4 models x 20 steps", "after 20 steps", "peak max logit", "mla-qknorm",
                 "absorbed decode path vs explicit path", "cache bytes per token", "sample through the latent cache",
                 "absorbed == explicit: ok"):
        assert text in out
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert {(r["attn"], r["lr"]) for r in summary["runs"]} == {
        (m, lr) for m in demo.MODELS for lr in demo.LEARNING_RATES.values()}
    assert all(r["status"] in ("done", "non-finite") and r["peak_max_logit"] > 0 for r in summary["runs"])
    assert summary["check"]["lm_logit_max_abs_diff"] < 1e-3
    assert (tmp_path / "curves.png").is_file()
    sizes = {(r["dtype"], r["variant"]): r["bytes_per_token_layer"] for r in summary["cache_bytes"]}
    assert sizes[("bf16", "mla-qknorm")] - sizes[("bf16", "mla")] == 2 * 4  # 4 heads, bf16 scalars


def test_demo_default_step_count_is_the_fixed_constant(tmp_path, monkeypatch, capsys):
    """No timing decides the length of the runs: without --steps every run trains demo.STEPS."""
    seen = []

    def fake_train_all(out, configs):
        seen.extend({c.steps for c in configs})
        raise RuntimeError("stopped by the test")

    monkeypatch.setattr(demo, "_train_all", fake_train_all)
    assert run_demo(out=str(tmp_path)) == 1
    assert seen == [demo.STEPS] and f"x {demo.STEPS} steps" in capsys.readouterr().out
