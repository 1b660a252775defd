import json

import pytest

pytest.importorskip("torchtitan")

from benchmarks import torchtitan_pretrain  # noqa: E402


def test_the_recipe_runs_the_three_arms_side_by_side_and_records_them(tmp_path):
    out = tmp_path / "r.json"
    assert torchtitan_pretrain.main(["--steps", "4", "--no-compile", "--batch", "2", "--seq", "32", "--warmup", "0",
                                     "--measure-every", "2", "--log-every", "1", "--tau", "0.1",
                                     "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["status"] == "complete" and record["command"].endswith(f"--out {out}")
    assert set(record["summary"]) == {"plain", "qk_norm", "qk_clip"}
    for name, s in record["summary"].items():
        assert s["timed_steps"] == 2 and s["median_step_s"] > 0, name
        # two measured steps of each layer (steps 0 and 2), the metric's per-layer figure
        assert sorted(record["max_logits_per_layer"][name]) == [f"layers.{i}.attention" for i in range(4)]
        assert all(len(v) == 2 for v in record["max_logits_per_layer"][name].values())
    assert record["summary"]["plain"]["median_step_ratio_to_plain"] == 1.0
    # tau = 0.1 binds at the first step (the logits start above it), and after each clip they are at most tau
    before, after = record["max_logits_per_layer"]["qk_clip"], record["qk_clip_max_logits_after_clip"]
    assert any(v[0] > 0.1 for v in before.values())
    assert sorted(after) == sorted(before) and all(x <= 0.1 + 1e-4 for v in after.values() for x in v)
    # the arms start from the same weights: plain's and QK-Clip's first losses are equal
    assert record["losses"]["plain"][0] == record["losses"]["qk_clip"][0]


def test_the_recipe_refuses_to_replace_a_result(tmp_path, capsys):
    out = tmp_path / "r.json"
    out.write_text("{}")
    with pytest.raises(SystemExit):
        torchtitan_pretrain.main(["--steps", "1", "--out", str(out)])
    assert "--overwrite" in capsys.readouterr().err


def test_a_run_that_fails_keeps_its_record_and_says_what_stopped_it(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(torchtitan_pretrain, "build_arm", broken)
    out = tmp_path / "r.json"
    with pytest.raises(RuntimeError, match="out of memory"):
        torchtitan_pretrain.main(["--steps", "2", "--no-compile", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["status"] == "failed" and record["error"] == "RuntimeError: out of memory"
