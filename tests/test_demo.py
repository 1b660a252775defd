import json

from qkmla.demo import run_demo


def test_demo_end_to_end_small(tmp_path, capsys):
    """The main job on the debug preset with few steps: every stage runs and is reported."""
    assert run_demo(out=str(tmp_path), steps=20, preset="debug") == 0
    out = capsys.readouterr().out
    for text in ("validation loss after 20 steps", "mla-qknorm", "absorbed decode path vs explicit path",
                 "cache bytes per token", "sample through the latent cache", "absorbed == explicit: ok"):
        assert text in out
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert set(summary["val_loss"]) == {"mla-qknorm", "mla"}
    assert summary["check"]["lm_logit_max_abs_diff"] < 1e-3
    assert (tmp_path / "curves.png").is_file()
    sizes = {(r["dtype"], r["variant"]): r["bytes_per_token_layer"] for r in summary["cache_bytes"]}
    assert sizes[("bf16", "mla-qknorm")] - sizes[("bf16", "mla")] == 2 * 4  # 4 heads, bf16 scalars
