"""Smoke runs of the benchmark scripts on a tiny layer: they run end to end and write the
JSON the README documents (the timings themselves are not asserted; see benchmarks/README.md)."""

import importlib.util
import json
import mmap
import re
from pathlib import Path

import pytest

from qkmla import mla_preset

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_decode_counts_the_page_faults_of_fresh_pages():
    bench = load("bench_decode")
    if bench.resource is None:
        pytest.skip("the OS does not report page faults")
    # An anonymous mapping is fresh pages whatever the allocator has kept from earlier tests
    # (a torch.empty of the same size may reuse freed memory and fault nothing).
    with mmap.mmap(-1, 64 << 20) as fresh:
        before = bench.minor_faults()
        for offset in range(0, len(fresh), 4096):
            fresh[offset] = 1  # the first touch of each page
        faults = bench.minor_faults() - before
    assert faults >= 16  # 4 KB pages: 16384; 2 MB huge pages: 32


def test_bench_decode_writes_rows_for_every_variant(tmp_path):
    bench = load("bench_decode")
    out = tmp_path / "decode.json"
    # aot_eager: the compiled mode's path without inductor's C++ build (the timing run uses inductor).
    assert bench.main(["--preset", "tiny", "--contexts", "32", "64", "--rounds", "2", "--out", str(out),
                       "--compile-backend", "aot_eager"]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("python benchmarks/bench_decode.py")
    assert result["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", result["commit"])
    assert "cpu" in result["machine"]
    assert result["modes"] == list(bench.DEFAULT_MODES) and result["old"] is None
    assert result["kv_formats"] == [] and "kv_format_over_bf16_step" not in result["summary"]  # only on request
    rows = result["rows"]
    variants = bench.mode_variants(bench.DEFAULT_MODES)
    assert {(r["context"], r["variant"]) for r in rows} == {(c, v) for c in (32, 64) for v in variants}
    for r in rows:
        assert set(r) == {"context", "variant", "seconds", "cache_bytes", "ratio_to_mla", "page_faults_per_call"}
        assert r["seconds"] > 0 and r["cache_bytes"] > 0
        if bench.resource is not None:  # every row is timed in this process here (no worker)
            assert r["page_faults_per_call"] >= 0
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
    # The byte floor reads what the QK-normed step reads (the same cache) and is no step itself.
    assert by[(64, "floor-absorbed")]["cache_bytes"] == by[(64, "absorbed-mla-qknorm")]["cache_bytes"]
    for c in (32, 64):
        assert summary["expand_over_floor"][str(c)] == pytest.approx(
            by[(c, "expand-qknorm")]["seconds"] / by[(c, "floor-absorbed")]["seconds"])
        fastest = bench.step_variant(summary["fastest_mode"][str(c)], True)
        assert summary["fastest_over_floor"][str(c)] == pytest.approx(
            by[(c, fastest)]["seconds"] / by[(c, "floor-absorbed")]["seconds"])
    for got in result["compile"]["per_context"].values():  # the compiled step computes the eager step's output
        for mode in ("compiled", "compiled-optimized"):
            assert max(got[mode]["max_abs_diff_to_eager"].values()) < 1e-4


def test_bench_decode_byte_floor_reads_every_weight_and_every_cached_row_once(monkeypatch):
    import torch

    from qkmla import MLA

    bench = load("bench_decode")
    module = MLA(mla_preset("tiny")).eval()
    latent, key_scale = torch.randn(3, 40, 24), torch.rand(3, 40, 2)
    reads = []
    linear, mv = torch.nn.functional.linear, torch.mv
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w: reads.append(w) or linear(x, w))
    monkeypatch.setattr(torch, "mv", lambda rows, v: reads.append(rows) or mv(rows, v))
    bench.byte_floor(module, latent, key_scale)()
    weights = [m.weight for m in module.modules() if isinstance(m, torch.nn.Linear)]
    assert len(weights) >= 4 and len(reads) == len(weights) + 3  # each weight once, then each sequence's rows
    assert all(r is w for r, w in zip(reads, weights))
    for b, rows in enumerate(reads[len(weights):]):
        assert rows.data_ptr() == latent[b].data_ptr() and rows.shape == latent[b].shape


def test_bench_decode_times_every_kv_format_against_bf16(tmp_path):
    """--kv-formats: the absorbed step over a bf16, fp8, int8 and int4 cache, eager and compiled,
    in the same rounds; bytes and step times over bf16's in the summary."""
    bench = load("bench_decode")
    out = tmp_path / "decode.json"
    formats = ["bf16", "fp8", "int8", "int4"]
    assert bench.main(["--preset", "tiny", "--contexts", "32", "64", "--rounds", "2", "--modes", "eager", "compiled",
                       "--kv-formats", *formats, "--compile-backend", "aot_eager", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["kv_formats"] == formats
    variants = bench.mode_variants(["eager", "compiled"], formats)
    assert {"absorbed-mla-fp8", "absorbed-mla-qknorm-fp8", "absorbed-mla-qknorm-int4-compiled"} <= set(variants)
    by = {(r["context"], r["variant"]): r for r in result["rows"]}
    assert set(by) == {(c, v) for c in (32, 64) for v in variants}
    tiny = mla_preset("tiny")  # d_c 32, d_r 8, G 4
    rope_bytes, scalar_bytes = 2 * tiny.qk_rope_head_dim, 2 * tiny.num_kv_groups  # both bfloat16
    per_token = {"bf16": 2 * (tiny.kv_lora_rank + tiny.qk_rope_head_dim),
                 "fp8": tiny.kv_lora_rank + 4 + rope_bytes, "int8": tiny.kv_lora_rank + 4 + rope_bytes,
                 "int4": tiny.kv_lora_rank // 2 + 4 + rope_bytes}
    qk_per_token = {f: n + scalar_bytes for f, n in per_token.items()}
    for f in formats:
        for suffix in ("", "-compiled"):  # bytes read per step: bytes per token x context, in both modes
            assert by[(64, f"absorbed-mla-{f}{suffix}")]["cache_bytes"] == 64 * per_token[f]
            assert by[(64, f"absorbed-mla-qknorm-{f}{suffix}")]["cache_bytes"] == 64 * qk_per_token[f]
            assert by[(64, f"absorbed-mla-{f}{suffix}")]["ratio_to_mla"] == 1.0  # plain MLA, same format and mode
    summary = result["summary"]
    assert summary["kv_format_bytes_per_token"]["fp8"] == {"mla": per_token["fp8"], "mla-qknorm": qk_per_token["fp8"]}
    bytes_over_bf16 = summary["kv_format_over_bf16_bytes"]
    assert set(bytes_over_bf16) == {"fp8", "int8", "int4"}
    assert bytes_over_bf16["int4"]["mla"] < bytes_over_bf16["fp8"]["mla"] == bytes_over_bf16["int8"]["mla"] < 1
    assert bytes_over_bf16["fp8"]["mla-qknorm"] == qk_per_token["fp8"] / qk_per_token["bf16"]
    step_over_bf16 = summary["kv_format_over_bf16_step"]
    assert set(step_over_bf16) == {"eager", "compiled"}
    for m, d in step_over_bf16.items():
        assert set(d) == {"fp8", "int8", "int4"}
        for f, per_context in d.items():
            assert set(per_context) == {"32", "64"}
            seconds = {g: by[(32, bench.step_variant(m, True, g))]["seconds"] for g in (f, "bf16")}
            assert per_context["32"]["mla-qknorm"] == pytest.approx(seconds[f] / seconds["bf16"])
    assert summary["targets"]["gpu_fp8_faster_and_fewer_bytes_than_bf16_from_32k"] is None
    for got in result["compile"]["per_context"].values():  # each compiled step computes its eager step's output
        assert set(got) == {"compiled", *(f"{f}-compiled" for f in formats)}
        for f in formats:
            diff = got[f"{f}-compiled"]["max_abs_diff_to_eager"]
            assert set(diff) == {f"absorbed-mla-{f}", f"absorbed-mla-qknorm-{f}"}
            assert max(diff.values()) < 1e-4


def test_bench_decode_times_another_checkout_in_a_worker(tmp_path):
    """--old-src: a child process imports the package under that directory (here this checkout's
    own src/, which exercises the protocol without git) and times its step in the same rounds;
    a second worker times this tree's step in the same harness, in every worker mode."""
    bench = load("bench_decode")
    out = tmp_path / "decode.json"
    src = Path(__file__).resolve().parents[1] / "src"
    assert bench.main(["--preset", "tiny", "--contexts", "32", "--rounds", "2", "--modes", "eager", "compiled",
                       "--compile-backend", "aot_eager", "--old-src", str(src), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["modes"] == ["eager", "compiled", "old"]
    assert result["old"]["qkmla"].startswith(str(src))
    worker_rows = {bench.worker_variant(m, q) for m in ("eager", "compiled") for q in (False, True)}
    variants = {r["variant"] for r in result["rows"]}
    assert variants >= {"old-absorbed-mla", "old-absorbed-mla-qknorm"} | worker_rows
    assert not any(v.startswith("worker-") and v.endswith("-compiled-optimized") for v in variants)  # not asked
    summary = result["summary"]
    assert summary["fastest_over_old_step"]["32"]["mode"] in ("eager", "compiled")
    assert summary["eager_over_old_step"]["32"]["mla-qknorm"] > 0
    same = summary["worker_fastest_over_old_step"]["32"]
    assert same["mode"] in ("eager", "compiled") and same["mla"] > 0 and same["mla-qknorm"] > 0
    assert set(summary["worker_over_old_step_by_mode"]) == {"eager", "compiled"}
    quartiles = summary["worker_fastest_over_old_step_per_round_quartiles"]["32"]
    assert set(quartiles) == {"mla", "mla-qknorm"} and all(len(q) == 3 for q in quartiles.values())
    assert summary["targets"]["fastest_no_slower_than_old_at_4k_and_16k_same_harness"] is None  # no 4k


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
    assert result["command"].startswith("python benchmarks/bench_decode_parts.py")
    assert result["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", result["commit"])
    parts = {r["part"] for r in result["rows"]}
    assert {"key-gemv", "key-gemv-linear", "scores-plain", "scores-split", "scores-split-addcmul", "scores-blockdiag",
            "latent-scores-mla", "latent-scores-qknorm", "rms-norm-cold", "key-gemv-split",
            "proj-linear-r1", "proj-split-r1", "proj-split-r32"} <= parts
    assert all(r["seconds"] > 0 for r in result["rows"])
    assert result["square_sgemm_gflops_per_s"] > 0


def test_bench_hf_generate_times_every_variant_on_a_tiny_model(monkeypatch):
    pytest.importorskip("transformers")
    bench = load("bench_hf_generate")
    monkeypatch.setattr(bench, "SHAPE", dict(bench.SHAPE, hidden_size=64, intermediate_size=64, q_lora_rank=32,
                                             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                             num_attention_heads=4, num_key_value_heads=4, vocab_size=64))
    rows = [bench.run_cell("float32", 200, v, steps=2, warmup=1, chunk=64, score_budget_gib=0.0, threads=1)
            for v in bench.VARIANTS]
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    assert rows[0]["prefill"].startswith("chunks of 64")  # a zero score budget chunks transformers' prefill
    row_bytes = 2 * (32 + 8) * 4  # two layers of [c; k_rope] in float32
    assert rows[0]["cache_bytes_per_token"] == rows[1]["cache_bytes_per_token"] == row_bytes
    assert rows[2]["cache_bytes_per_token"] < row_bytes  # fp8 latents
    assert rows[3]["cache_bytes_per_context_token"] < 0.5 * row_bytes  # SnapKV kept a quarter of the prompt
    summary = bench.summarize(rows)
    assert [s["variant"] for s in summary] == ["qkmla", "qkmla-fp8", "qkmla-snapkv"]
    assert all(s["decode_speedup"] > 0 for s in summary)


def test_bench_hf_generate_refuses_to_replace_a_results_file(tmp_path, capsys):
    bench = load("bench_hf_generate")
    out = tmp_path / "r.json"
    out.write_text("{}")
    with pytest.raises(SystemExit):
        bench.main(["--out", str(out)])
    assert "--out: " in capsys.readouterr().err and out.read_text() == "{}"


def test_bench_threads_times_both_choices_with_and_without_a_held_core(tmp_path):
    """The four cells run and auto records how many threads it used (a debug-sized run)."""
    bench = load("bench_threads")
    out = tmp_path / "t.json"
    assert bench.main(["--preset", "debug", "--steps", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["another_process_holds_a_core"], r["threads_option"] == "auto") for r in rows] == [
        (False, False), (False, True), (True, False), (True, True)]
    assert all(r["seconds"] > 0 and r["threads"] >= 1 for r in rows)
    held_auto = rows[3]
    assert held_auto["threads"] <= max(1, rows[2]["threads"] - 1)  # a held core is left to its holder
    with pytest.raises(SystemExit):
        bench.main(["--out", str(out)])
