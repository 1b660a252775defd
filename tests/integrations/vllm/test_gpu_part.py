"""The GPU suite's vLLM part (benchmarks/gpu/part_vllm.py) in its dry run, on the CPU with vLLM."""

import json

import pytest

pytest.importorskip("vllm")

from benchmarks.gpu import part_vllm, run  # noqa: E402


def test_the_gpu_suites_vllm_part_runs_its_dry_run(tmp_path):
    """Part 7 on the CPU at tiny shapes: the plugin's GPU-only tests (skipped here), then the QK-normed
    checkpoint through qkmla's CPU backend and the plain one through vLLM's CPU_MLA, each an engine of
    its own, a row per arm and point with the fields the real run fills on a GPU; the GPU-only arm
    (FlashMLA) recorded as not run."""
    out = tmp_path / "dry"
    assert run.main(["--dry-run", "--parts", "vllm", "--out", str(out)]) == 0
    record = json.loads((out / "7_vllm.json").read_text())
    assert record["status"] == "ok", (record.get("errors"), record.get("error"))
    assert record["not_run"] == ["FLASHMLA (a GPU backend)"]
    # the plugin's GPU-only tests, run first in a process of their own: here they skip
    unit = record["unit_tests"]
    assert (unit["passed"], unit["failed"], unit["errors"], unit["skipped"]) == (0, 0, 0, 3), unit
    assert unit["command"].endswith("-k on_a_gpu " + " ".join(part_vllm.UNIT_TESTS))
    assert (out / "7_vllm_unit_tests.log").exists()
    rows = {(r["arm"], r["context"], r["batch"]): r for r in record["rows"]}
    points = [(c, b) for c in part_vllm.DRY["contexts"] for b in part_vllm.DRY["batches"]]
    assert set(rows) == {(arm, c, b) for arm in ("qknorm", "TRITON_MLA") for c, b in points}
    for r in rows.values():
        assert r["median_step_ms"] > 0 and r["median_attention_ms"] > 0 and r["decode_tokens_per_s"] > 0
    for c, b in points:
        qk, stock = rows[("qknorm", c, b)], rows[("TRITON_MLA", c, b)]
        # 4 heads: 4 key scalars of 4 bytes beside vLLM's 576 float32 values
        assert (qk["kv_bytes_per_token_per_layer"], stock["kv_bytes_per_token_per_layer"]) == (580 * 4, 576 * 4)
        assert qk["step_over_TRITON_MLA"] == qk["median_step_ms"] / stock["median_step_ms"]
        assert qk["step_over_FLASHMLA"] is None
    assert "## 7. vllm" in (out / "summary.md").read_text()
