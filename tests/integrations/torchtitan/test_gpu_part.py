import json

import pytest

pytest.importorskip("torchtitan")

from benchmarks.gpu import run  # noqa: E402


def test_the_gpu_suites_torchtitan_part_runs_its_dry_run(tmp_path):
    """Part 6 on the CPU at the dry run's tiny shapes: every arm through torchtitan's apply_compile
    (aot_eager), a row each with the fields the real run fills on a GPU."""
    out = tmp_path / "dry"
    assert run.main(["--dry-run", "--parts", "torchtitan", "--out", str(out)]) == 0
    record = json.loads((out / "6_torchtitan.json").read_text())
    assert record["status"] == "ok", record.get("errors")
    rows = {r["arm"]: r for r in record["rows"]}
    assert set(rows) == {"plain", "qk_norm", "qk_clip"}
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["steps"] == 3 and len(r["losses"]) == 3
        assert r["mfu"] is None and r["peak_memory_gib"] is None  # GPU figures: none on the CPU
    assert rows["plain"]["ratio_to_plain"] == 1.0
    # the dry run's tau (0.1) binds: the clip ran, and left the last step's logits at most tau
    assert rows["plain"]["max_logit_after_last_clip"] is None
    assert 0 < rows["qk_clip"]["max_logit_after_last_clip"] <= 0.1 + 1e-6
    assert "## 6. torchtitan" in (out / "summary.md").read_text()
