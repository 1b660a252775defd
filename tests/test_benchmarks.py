"""Smoke runs of the benchmark scripts on a tiny layer: they run end to end and write the
JSON the README documents (the timings themselves are not asserted; see benchmarks/README.md)."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_decode_writes_rows_for_every_variant(tmp_path):
    bench = load("bench_decode")
    out = tmp_path / "decode.json"
    # aot_eager: the compiled mode's path without inductor's C++ build (the timing run uses inductor).
    assert bench.main(["--preset", "tiny", "--contexts", "32", "64", "--rounds", "2", "--out", str(out),
                       "--compile-backend", "aot_eager"]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("python benchmarks/bench_decode.py")
    assert "cpu" in result["machine"]
    assert result["modes"] == list(bench.DEFAULT_MODES) and result["old"] is None
    rows = result["rows"]
    variants = bench.mode_variants(bench.DEFAULT_MODES)
    assert {(r["context"], r["variant"]) for r in rows} == {(c, v) for c in (32, 64) for v in variants}
    for r in rows:
        assert set(r) == {"context", "variant", "seconds", "cache_bytes", "ratio_to_mla"}
        assert r["seconds"] > 0 and r["cache_bytes"] > 0
    by = {(r["context"], r["variant"]): r for r in rows}
    assert by[(64, "absorbed-mla")]["ratio_to_mla"] == 1.0
    assert by[(64, "absorbed-mla-compiled")]["ratio_to_mla"] == 1.0  # each mode against plain MLA in that mode
    # Cache bytes double with the context and the QK-normed latent cache is the plain one plus G scalars.
    assert by[(64, "absorbed-mla-qknorm")]["cache_bytes"] == 2 * by[(32, "absorbed-mla-qknorm")]["cache_bytes"]
    assert by[(64, "absorbed-mla-qknorm")]["cache_bytes"] > by[(64, "absorbed-mla")]["cache_bytes"]
    summary = result["summary"]
    quartiles = summary["qknorm_over_mla_step_per_round_quartiles"]
    assert all(q[0] <= q[1] <= q[2] for q in quartiles.values())
    assert set(summary["qknorm_over_mla_step_by_mode"]) == set(bench.DEFAULT_MODES)
    assert set(summary["step_over_eager_by_mode"]) == {"optimized", "compiled", "compiled-optimized"}
    assert set(summary["fastest_mode"].values()) <= set(bench.DEFAULT_MODES)
    assert set(summary["targets"].values()) == {None}  # no context reaches 4k, no old step
    for got in result["compile"]["per_context"].values():  # the compiled step computes the eager step's output
        for mode in ("compiled", "compiled-optimized"):
            assert max(got[mode]["max_abs_diff_to_eager"].values()) < 1e-4


def test_bench_decode_times_another_checkout_in_a_worker(tmp_path):
    """--old-src: a child process imports the package under that directory (here this checkout's
    own src/, which exercises the protocol without git) and times its step in the same rounds."""
    bench = load("bench_decode")
    out = tmp_path / "decode.json"
    src = Path(__file__).resolve().parents[1] / "src"
    assert bench.main(["--preset", "tiny", "--contexts", "32", "--rounds", "2", "--modes", "eager",
                       "--old-src", str(src), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["modes"] == ["eager", "old"]
    assert result["old"]["qkmla"].startswith(str(src))
    assert {r["variant"] for r in result["rows"]} >= {"old-absorbed-mla", "old-absorbed-mla-qknorm"}
    assert result["summary"]["fastest_over_old_step"]["32"]["mode"] == "eager"
    assert result["summary"]["eager_over_old_step"]["32"]["mla-qknorm"] > 0


def test_bench_decode_rejects_an_unknown_dtype(capsys):
    bench = load("bench_decode")
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny", "--dtype", "float8"])
    assert "--dtype" in capsys.readouterr().err


def test_bench_decode_parts_times_every_part(tmp_path):
    bench = load("bench_decode_parts")
    out = tmp_path / "parts.json"
    assert bench.main(["--contexts", "64", "--rounds", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    parts = {r["part"] for r in result["rows"]}
    assert {"key-gemv", "key-gemv-linear", "scores-plain", "scores-split", "scores-split-addcmul", "scores-blockdiag",
            "latent-scores-mla", "latent-scores-qknorm", "rms-norm-cold", "key-gemv-split",
            "proj-linear-r1", "proj-split-r1", "proj-split-r32"} <= parts
    assert all(r["seconds"] > 0 for r in result["rows"])
    assert result["square_sgemm_gflops_per_s"] > 0
