"""Smoke runs of the benchmarks (modules of the ``benchmarks`` package, run from the repository
root) on a tiny layer: they run end to end and write the JSON docs/benchmarks.md documents (the
timings themselves are not asserted)."""

import argparse
import importlib
import json
import re
from pathlib import Path

import pytest
import torch

from qkmla import mla_preset

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    """The benchmark ``benchmarks.<name>``."""
    return importlib.import_module(f"benchmarks.{name}")


def test_bench_decode_times_every_row_over_one_cache_per_row(tmp_path):
    bench = load("bench_decode")
    out = tmp_path / "decode.json"
    # aot_eager: the compiled rows' path without inductor's C++ build (the committed run uses inductor).
    assert bench.main(["--preset", "tiny", "--contexts", "64", "32", "--rounds", "2", "--threads", "1",
                       "--compile-backend", "aot_eager", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m benchmarks.bench_decode ")
    assert result["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", result["commit"])
    assert result["machine"]["torch_threads"] == 1 and set(result["load_average_1min"]) == {"start", "end"}
    names = {"mla", "mla-qknorm", "mla-compiled", "mla-qknorm-compiled", "expand-qknorm"}
    if result["transformers"] is not None:
        names.add("transformers")
    by = {(r["context"], r["row"]): r for r in result["rows"]}
    assert set(by) == {(c, n) for c in (32, 64) for n in names}  # contexts in increasing order
    assert all(r["ms"] > 0 for r in result["rows"])
    assert by[(64, "mla")]["ratio_to_mla"] == by[(64, "mla-compiled")]["ratio_to_mla"] == 1.0
    tiny = mla_preset("tiny")  # float32: (d_c + d_r) * 4 bytes, and G scalars more with QK-norm
    row = (tiny.kv_lora_rank + tiny.qk_rope_head_dim) * 4
    assert by[(64, "mla")]["cache_bytes_per_token"] == by[(64, "mla-compiled")]["cache_bytes_per_token"] == row
    assert by[(64, "mla-qknorm")]["cache_bytes_per_token"] == row + 4 * tiny.num_kv_groups
    assert by[(64, "expand-qknorm")]["cache_bytes_per_token"] == row + 4 * tiny.num_kv_groups
    if result["transformers"] is not None:  # transformers 5.15+ caches the latent and RoPE key, as plain MLA does
        assert by[(64, "transformers")]["cache_bytes_per_token"] >= row
    summary = result["summary"]
    heads_full_key = tiny.num_kv_groups * (tiny.qk_nope_head_dim + tiny.qk_rope_head_dim + tiny.v_head_dim) * 4
    assert summary["full_key_cache_bytes_per_token"] == heads_full_key
    assert summary["qknorm_over_mla"]["32"] == by[(32, "mla-qknorm")]["ratio_to_mla"] > 0  # taken round by round
    # at least one timed call a round (more where 30 ms holds several: not on a loaded machine)
    assert all(r["calls"] >= 2 for r in result["rows"])
    for per_context in result["compile"]["per_context"].values():  # the compiled step computes the eager step's output
        assert max(d["max_abs_diff_to_eager"] for d in per_context.values()) < 1e-4
    with pytest.raises(SystemExit):  # an existing result is not replaced without --overwrite
        bench.main(["--preset", "tiny", "--contexts", "32", "--out", str(out)])


def test_bench_decode_on_a_paged_batch_times_the_two_eager_rows(tmp_path):
    bench = load("bench_decode")
    out = tmp_path / "paged.json"
    assert bench.main(["--preset", "tiny", "--contexts", "40", "--rounds", "2", "--threads", "1", "--batch", "3",
                       "--paged", "16", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["batch"], result["cache_layout"]) == (3, "paged, 16-token blocks")
    assert {r["row"] for r in result["rows"]} == {"mla", "mla-qknorm"} and result["transformers"] is None
    assert set(result["summary"]["qknorm_over_mla"]) == {"40"} and result["summary"]["qknorm_over_mla_compiled"] == {}


BAD_ARGUMENTS = [  # (script, the arguments it is given, the option its refusal must name)
    *[("bench_decode", ["--preset", "tiny", *argv], option) for argv, option in [
        (["--contexts", "0"], "--contexts"), (["--rounds", "0"], "--rounds"), (["--threads", "-1"], "--threads"),
        (["--dtype", "float8"], "--dtype"), (["--batch", "0"], "--batch"), (["--paged", "-1"], "--paged")]],
    *[("bench_paged_layouts", argv, option) for argv, option in [
        (["--points", "100x1"], "--points"), (["--points", "4096"], "--points"), (["--reps", "0"], "--reps"),
        (["--profile", "32x0"], "--profile"), (["--baseline", "no-such-revision"], "--baseline")]],
    *[("bench_cpu_kernel", argv, option) for argv, option in [
        (["--heads", "0"], "--heads"), (["--points", "100x1"], "--points"), (["--threads", "0"], "--threads")]],
    *[("bench_small_linear", argv, option) for argv, option in [
        (["--shapes", "64x33"], "--shapes"), (["--shapes", "64"], "--shapes"), (["--rows", "0"], "--rows"),
        (["--statistic", "--shapes", "64x32"], "--shapes"), (["--shapes", "2x32x64"], "--shapes")]],
    *[("vllm_serving", ["--parts", "decode", *argv], option) for argv, option in [
        (["--rounds", "0"], "--rounds"), (["--sessions", "3", "--rounds", "2"], "--sessions")]],
    # the transformers cell benchmarks share their checks (benchmarks/common.parse_cell_args)
    *[(script, argv, option) for script in ("bench_hf_generate", "bench_hf_sparse", "bench_hf_compile")
      for argv, option in [(["--threads", "-1"], "--threads"), (["--steps", "0"], "--steps"),
                           (["--warmup", "-1"], "--warmup"), (["--contexts", "1"], "--contexts")]],
    ("bench_hf_generate", ["--chunk", "0"], "--chunk"), ("bench_hf_sparse", ["--prefill-max", "-1"], "--prefill-max"),
    ("bench_hf_sparse", ["--baseline-steps", "0"], "--baseline-steps"),
]


@pytest.mark.parametrize("script, argv, option", BAD_ARGUMENTS)
def test_benchmarks_refuse_bad_arguments_naming_them(script, argv, option, capsys):
    with pytest.raises(SystemExit):
        load(script).main(argv)
    assert option in capsys.readouterr().err


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


def test_bench_hf_sparse_times_every_variant_both_fills_on_a_tiny_model(monkeypatch):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV32ForCausalLM"):
        pytest.skip("DeepSeek-V3.2 is not in this transformers")
    bench = load("bench_hf_sparse")
    monkeypatch.setattr(bench, "SHAPE", dict(bench.SHAPE, hidden_size=64, intermediate_size=64, q_lora_rank=32,
                                             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                             num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
                                             index_topk=16, index_head_dim=16, index_n_heads=4))
    monkeypatch.setattr(bench, "FILL_CHUNK", 64)
    models = ("transformers", "qkmla", "qkmla-qknorm")
    assert bench.VARIANTS == (*models, bench.PAIRED)
    rows = [bench.run_cell("float32", context, v, steps=2, warmup=1, chunk=64, prefill_max=100, threads=1)
            for context in (100, 150) for v in bench.VARIANTS]
    assert [(r["context"], r["variant"]) for r in rows] == [(c, v) for c in (100, 150) for v in bench.VARIANTS]
    assert rows[0]["fill"] == "prefill, chunks of 64" and rows[0]["prefill_s"] > 0
    assert rows[4]["fill"].startswith("by projection") and rows[4]["prefill_s"] is None
    for row in (r for r in rows if r["variant"] in models):  # two layers: the indexer's keys, 16 floats a token
        assert row["indexer_key_bytes_per_token"] == 2 * 16 * 4
    assert rows[0]["attention_cache_bytes_per_token"] == rows[1]["attention_cache_bytes_per_token"] == 2 * 40 * 4
    assert rows[2]["attention_cache_bytes_per_token"] == 2 * (40 + 4) * 4  # + a key scalar per head (KV group)
    paired = rows[3]  # two pairs timed: each ratio a positive number, the median between them
    assert paired["pairs_timed"] == 2 and paired["median_plain_built_first"] > 0  # a pair in each build order
    assert 0 < paired["ratio_min"] <= paired["decode_time_vs_plain"] <= paired["ratio_max"]
    assert paired["ratio_min"] <= paired["median_95ci"][0] <= paired["median_95ci"][1] <= paired["ratio_max"]
    summary = bench.summarize(rows)
    assert [s["variant"] for s in summary] == ["qkmla", "qkmla-qknorm"] * 2
    assert all(s["decode_speedup"] > 0 for s in summary) and "decode_time_vs_plain" in summary[1]
    assert summary[1]["decode_time_vs_plain_paired"] == paired["decode_time_vs_plain"]


def test_bench_hf_sparse_median_interval_covers_the_median_and_narrows_with_more_pairs():
    bench = load("bench_hf_sparse")
    few = [1.0, 1.2, 0.9, 1.1, 1.05]
    low, high = bench.median_interval(few)
    assert min(few) <= low <= 1.05 <= high <= max(few)
    many = few * 20  # the same spread, 20 times the pairs
    low_many, high_many = bench.median_interval(many)
    assert high_many - low_many < high - low
    # two strata (build orders) far apart: each resample keeps half its pairs from each
    two = [1.0, 1.01, 0.99, 1.02] + [1.2, 1.21, 1.19, 1.22]
    low_two, high_two = bench.median_interval(two, strata=2)
    assert 1.02 <= low_two <= high_two <= 1.2


def test_bench_hf_sparse_times_the_baseline_over_its_own_steps(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    bench, common = load("bench_hf_sparse"), load("common")
    seen = []
    def run_cells(module, cells, result, write, summarize):
        seen.extend(cells)
        result["summary"] = []

    monkeypatch.setattr(common, "run_cells", run_cells)
    bench.main(["--contexts", "64", "--dtypes", "float32", "--steps", "5", "--baseline-steps", "2",
                "--out", str(tmp_path / "r.json")])
    assert {c["variant"]: c["steps"] for c in seen} == {"transformers": 2, "qkmla": 5, "qkmla-qknorm": 5,
                                                        bench.PAIRED: 5}


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


def test_bench_paged_layouts_pairs_plain_and_qknorm_on_both_layouts(tmp_path):
    bench = load("bench_paged_layouts")
    out, threads = tmp_path / "layouts.json", torch.get_num_threads()
    assert bench.main(["--points", "32x2", "48x1", "--reps", "3", "--profile", "32x1", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # measured on one thread, the caller's count given back
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m benchmarks.bench_paged_layouts ")
    assert result["machine"]["torch_threads"] == 1 and result["target"] == round(1 + 16 / 576 + 0.02, 4)
    assert [(r["layout"], r["context"], r["batch"]) for r in result["rows"] if r["backend"] == "torch"] == [
        ("row", 32, 2), ("block", 32, 2), ("row", 48, 1), ("block", 48, 1)]
    backends = bench.default_backends()
    assert [r["backend"] for r in result["rows"]] == [b for b in backends for _ in range(4)]
    if backends == ["torch", "cpu"]:  # the kernel against the torch backend, both variants at each point
        assert [(r["variant"], r["context"]) for r in result["kernel_rows"]] == [
            ("plain", 32), ("qknorm", 32), ("plain", 48), ("qknorm", 48)]
        assert all(r["torch_ms"] > 0 and r["cpu_ms"] > 0 for r in result["kernel_rows"])
    assert all(r["plain_ms"] > 0 and r["qknorm_ms"] > 0 and r["qknorm_over_plain"] > 0 for r in result["rows"])
    profile = result["profile"]
    assert (profile["layout"], profile["context"], profile["batch"]) == ("row", 32, 1)
    assert "aten::bmm" in {op["op"] for op in profile["ops_us"]} and profile["total_us"]["qknorm"] > 0


def test_bench_paged_layouts_times_the_backend_against_a_git_revision(tmp_path):
    """--baseline REV: the torch backend at REV, loaded from git beside the current one, decodes
    the same cache to the same values, and both variants get a side-by-side row."""
    from torch._library.custom_ops import OPDEFS

    bench = load("bench_paged_layouts")
    current_op = OPDEFS["qkmla::latent_attention"]
    try:
        at_head = bench.backend_at("HEAD")
    except ValueError:
        pytest.skip("not a git checkout")
    assert OPDEFS["qkmla::latent_attention"] is current_op  # the old file's custom op not registered over it
    (before, now), _ = bench.baseline_calls(at_head, 32, 2).values()
    assert torch.equal(before()[0], now()[0])
    out = tmp_path / "baseline.json"
    assert bench.main(["--points", "32x2", "--reps", "2", "--baseline", "HEAD", "--out", str(out)]) == 0
    baseline = json.loads(out.read_text())["baseline"]
    assert baseline["rev"] == "HEAD"
    assert [(r["variant"], r["context"], r["batch"]) for r in baseline["rows"]] == [("plain", 32, 2), ("qknorm", 32, 2)]
    assert all(r["baseline_ms"] > 0 and r["current_ms"] > 0 and r["current_over_baseline"] > 0
               for r in baseline["rows"])


def test_bench_paged_layouts_caches_hold_the_same_values_in_both_layouts():
    """Each layout's views read back the rows and scalars it was given: the two calls of a point
    decode the same cache, and the block layout puts a block's scalars after its rows."""
    bench = load("bench_paged_layouts")
    for layout in bench.LAYOUTS:
        plain, rows, scalars, table = bench.caches(layout, 32, 2, torch.Generator().manual_seed(0))
        assert rows.shape[1:] == (16, 576) and scalars.shape[1:] == (16, 16) and table.shape == (2, 2)
        assert plain.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
        assert bool((scalars > 0).all())
        if layout == "block":  # rows then scalars, per block
            assert scalars.storage_offset() == 16 * 576 and rows.stride(0) == 16 * 592
        else:
            assert scalars.storage_offset() == 576 and rows.stride(1) == 592


def test_vllm_serving_pairs_each_round_and_takes_the_median_ratio():
    """The decode summary of vllm_serving.py (no vLLM needed): ratios pair the variants' measurements
    of one round, so a slow round slows both sides of its pair; the target is judged on their median."""
    bench = load("vllm_serving")
    runs = []
    for context, first_qk in ((64, 2.08), (128, 2.2)):
        for round_, (plain, qk, stock) in enumerate([(2.0, first_qk, 1.0), (4.0, 4.0, 2.0), (2.0, 3.0, 1.0)]):
            for variant, ms, row_bytes in (("plain-qkmla", plain, 1152), ("qknorm", qk, 1184), ("stock", stock, 1152)):
                runs.append({"variant": variant, "session": 0, "round": round_, "context": context, "batch": 2,
                             "kv_bytes_per_token_per_layer": row_bytes, "median_step_ms": ms,
                             "median_attention_ms": ms / 2, "decode_tokens_per_s": 2e3 / ms})
    result = {"decode_runs": runs}
    bench.summarize_decode(result, {"stock": (None, 0), "plain-qkmla": (None, 0), "qknorm": (None, 16)}, 2)
    within, beyond = sorted(result["ratios"], key=lambda r: r["context"])
    assert within["qknorm_over_plain_qkmla_time_by_round"] == [1.04, 1.0, 1.5]
    assert within["qknorm_over_plain_qkmla_time"] == 1.04 and within["extra_bytes"] == 0.0278
    assert within["within_target"] and within["attention_within_target"]  # 1.04 <= 1184 / 1152 + 0.02
    assert within["qknorm_over_stock_time"] == 2.08 and within["qknorm_over_plain_qkmla_attention_time"] == 1.04
    assert beyond["qknorm_over_plain_qkmla_time"] == 1.1 and not beyond["within_target"]
    plain = next(r for r in result["decode"] if r["variant"] == "plain-qkmla" and r["context"] == 64)
    assert (plain["median_step_ms"], plain["fastest_step_ms"], plain["rounds"]) == (2.0, 2.0, 3)
    assert plain["kv_bytes_expected"] == (512 + 64) * 2


def test_vllm_serving_reports_an_engine_that_exits_with_its_log(tmp_path):
    """A decode worker whose engine cannot start (here: no checkpoint; without vLLM, no vLLM) is
    reported by name with the log it left, not left waiting on its pipe."""
    bench = load("vllm_serving")
    spec = {"model": str(tmp_path / "missing"), "dtype": "float32", "max_model_len": 64, "new_tokens": 2,
            "warm_batch": 1}
    starting = bench.DecodeWorker(spec, tmp_path / "starting.log")
    with pytest.raises(RuntimeError, match="exited .* before starting; its log: .*starting.log"):
        starting.reply("starting")
    assert (tmp_path / "starting.log").read_text()  # the engine's traceback stays in the log
    assert starting.proc.returncode not in (None, 0)
    gone = bench.DecodeWorker(spec, tmp_path / "gone.log")
    gone.proc.wait()  # an engine that died between two measurements: its stdin is a broken pipe
    with pytest.raises(RuntimeError, match="before measuring context 8, batch 1; its log: .*gone.log"):
        gone.measure(8, 1)


def test_bench_cpu_kernel_times_the_kernel_beside_the_torch_backend(tmp_path):
    from qkmla.ops.mla_decode.cpu_kernel import AUTO_MAX_QUERY_HEADS, cpu_unsupported_for

    reason = cpu_unsupported_for("cpu", 512, 64, torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)
    bench, out, threads = load("bench_cpu_kernel"), tmp_path / "kernel.json", torch.get_num_threads()
    assert bench.main(["--heads", "16", "20", "--queries", "1", "2", "--points", "32x2", "--reps", "1",
                       "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m benchmarks.bench_cpu_kernel ")
    assert result["auto_max_query_heads"] == AUTO_MAX_QUERY_HEADS and result["machine"]["torch_threads"] == 2
    assert [(r["heads"], r["queries"]) for r in result["rows"]] == [(16, 1), (16, 2), (20, 1), (20, 2)]
    assert all(r["torch_ms"] > 0 and r["cpu_ms"] > 0 for r in result["rows"])
    calls = bench.calls(20, 2, 32, 2)  # both backends decode the same cache within bf16's roundoff
    (t_out, t_lse), (c_out, c_lse) = calls["torch"](), calls["cpu"]()
    torch.testing.assert_close(c_lse, t_lse, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(c_out.float(), t_out.float(), rtol=3e-2, atol=3e-2)


def test_bench_small_linear_times_the_kernel_beside_f_linear(tmp_path):
    from qkmla.ops.small_linear import kernel_unavailable

    if kernel_unavailable() is not None:
        pytest.skip(kernel_unavailable())
    bench, out, threads = load("bench_small_linear"), tmp_path / "linear.json", torch.get_num_threads()
    assert bench.main(["--shapes", "128x64", "--rows", "1", "5", "--threads", "1", "--reps", "1", "--calls", "2",
                       "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m benchmarks.bench_small_linear ")
    assert [(r["N"], r["K"], r["rows"]) for r in result["rows"]] == [(128, 64, 1), (128, 64, 5)]
    assert all(r["linear_us"] > 0 and r["kernel_us"] > 0 for r in result["rows"])
    assert "amx" in result["machine"] and result["what"].startswith("product")
    assert bench.main(["--statistic", "--shapes", "4x32x64", "--rows", "3", "--threads", "1", "--reps", "1",
                       "--calls", "2", "--out", str(out), "--overwrite"]) == 0
    result = json.loads(out.read_text())
    assert result["what"].startswith("statistic")
    assert [(r["G"], r["group"], r["N"], r["K"], r["rows"]) for r in result["rows"]] == [(4, 32, 128, 64, 3)]
    assert all(r["linear_us"] > 0 and r["kernel_us"] > 0 for r in result["rows"])


ROOT = BENCHMARKS.parent


def test_committed_runs_are_thinned_as_their_manifests_record_and_recompute_every_results_row():
    """The per-step metrics of the committed runs are thinned (benchmarks/thin_metrics.py), each file
    the blob its directory's manifest names, and ``summarize`` over the run directories gives every
    committed results row as it stands; the demo's peak and final max logits recompute too."""
    from qkmla.experiments.grid import Run
    from qkmla.experiments.results import read_results, summarize

    thin = load("thin_metrics")
    found = thin.targets(ROOT)
    assert {where.name for where in found} == {"demo", "lp-paper", "qknorm-vs-clip", "retrieval-bracket"}
    for where, files in found.items():
        manifest = json.loads((where / thin.MANIFEST).read_text())["files"]
        assert sorted(manifest) == [f.relative_to(ROOT).as_posix() for f in files]
        assert all(thin.blob_id(f.read_bytes()) == manifest[f.relative_to(ROOT).as_posix()]["blob"] for f in files)
        if where.name == "demo":
            for run in json.loads((where / "demo.json").read_text())["runs"]:
                rows = thin.read((where / Path(run["dir"]).name / "metrics.jsonl").read_bytes())
                assert (max(r["max_logit"] for r in rows), rows[-1]["max_logit"]) == (run["peak_max_logit"],
                                                                                     run["final_max_logit"])
            continue
        for row in read_results(where / "results.jsonl"):
            got = summarize(row["experiment"], Run(row["run"], row["variant"], {}, same_as=row.get("same_as")), where)
            assert got == {k: row.get(k) for k in got}, row["run"]


def test_runs_archived_thinned_by_their_experiment_recompute_every_results_row():
    """An experiment that archives its metrics thinned (qknorm-confirm, v4-compare: ``Experiment.thin_metrics``) is
    left alone by benchmarks/thin_metrics.py, and its committed runs give its committed results rows."""
    from qkmla.experiments.grid import Run
    from qkmla.experiments.results import read_results, summarize

    thin = load("thin_metrics")
    assert thin.self_thinned() == {"qknorm-confirm", "v4-compare"}
    for name in thin.self_thinned():
        where = BENCHMARKS / "results" / "experiments" / name
        if not (where / "results.jsonl").is_file():
            continue  # not committed yet
        for row in read_results(where / "results.jsonl"):
            if row["status"] == "done":
                got = summarize(row["experiment"], Run(row["run"], row["variant"], {}), where)
                assert got == {k: row.get(k) for k in got}, row["run"]


def test_qknorm_vs_clip_measures_recompute_from_its_thinned_runs(monkeypatch):
    """Its measure over the thinned files (the part that reads metrics: spikes, the late and peak
    logits and gradient norm, clipping, and the curves but grad_norm and lr, whose points are kept
    rows) gives each run's committed measure.json."""
    from qkmla.experiments.qknorm_vs_clip import design

    monkeypatch.setattr(design, "read_status", lambda path: None)  # stop before the checkpoint, not committed
    monkeypatch.setattr(design, "source_commit", lambda path: None)
    runs = sorted((BENCHMARKS / "results" / "experiments" / "qknorm-vs-clip" / "runs").iterdir())
    assert len(runs) == 50
    for run in runs:
        committed, got = json.loads((run / "measure.json").read_text()), design.measure(run)
        for measured in (committed, got):
            del measured["commit"], measured["curves"]["grad_norm"], measured["curves"]["lr"]
        assert got == {k: committed[k] for k in got}, run.name


def test_thin_metrics_keeps_what_qkmla_reads_and_restores_the_full_file(tmp_path):
    """A metrics file as the trainer writes it, committed: thinned to the rows and fields qkmla reads
    (every derived value the same), left alone the second time, and given back byte for byte."""
    import subprocess

    thin = load("thin_metrics")
    run = tmp_path / "benchmarks" / "results" / "experiments" / "grid" / "runs" / "a"
    run.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    rows = [{"step": s, "loss": float(torch.rand(1, generator=gen)), "lr": 1e-3, "grad_norm": float(s % 7),
             "max_logit": float(s % 13), "max_logit_per_layer": [1.0, 2.0], "tokens_per_s": 9.0,
             "step_seconds": float(torch.rand(1, generator=gen)),
             **({"val_loss": 2.0 - s / 1e3} if s % 50 == 0 else {})} for s in range(1, 301)]
    full = thin.dump(rows)
    (run / "metrics.jsonl").write_bytes(full)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "metrics"], check=True)
    assert thin.main(["--root", str(tmp_path)]) == 0
    small = thin.read((run / "metrics.jsonl").read_bytes())
    assert len(small) < len(rows) // 5 and not any("max_logit_per_layer" in r or "tokens_per_s" in r for r in small)
    assert thin.derived(small, dense=False) == thin.derived(rows, dense=False)
    manifest = json.loads((run.parents[1] / thin.MANIFEST).read_text())
    assert manifest["files"]["benchmarks/results/experiments/grid/runs/a/metrics.jsonl"]["original_rows"] == 300
    thinned = (run / "metrics.jsonl").read_bytes()
    assert thin.main(["--root", str(tmp_path)]) == 0 and (run / "metrics.jsonl").read_bytes() == thinned
    assert thin.main(["--root", str(tmp_path), "--restore"]) == 0
    assert (run / "metrics.jsonl").read_bytes() == full and not (run.parents[1] / thin.MANIFEST).exists()


def test_a_cell_benchmark_runs_each_cell_in_a_process_of_its_own_and_keeps_a_failed_cells_error(tmp_path, capsys):
    """benchmarks/common: ``--cell`` prints the one row its process measured; run_cells records a cell
    whose process fails (here a module that does not exist) with its error and goes on."""
    common = load("common")
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", type=int, nargs="+", default=[8])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0)
    common.add_cell_options(parser, threads=1, threads_help="")
    cell = {"context": 8, "variant": "v"}
    assert common.parse_cell_args(parser, ["--cell", json.dumps(cell)], lambda **c: {**c, "ms": 1.0}) is None
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {**cell, "ms": 1.0}
    result, written = {"rows": []}, []
    rows = common.run_cells("benchmarks.no_such_benchmark", [dict(cell, dtype_name="float32"), cell], result,
                            lambda: written.append(len(result["rows"])), summarize=len)
    assert [(r["context"], r.get("dtype"), "No module named" in r["error"]) for r in rows] == \
        [(8, "float32", True), (8, None, True)]
    assert written == [1, 2] and result["summary"] == 2
    capsys.readouterr()
    parser.add_argument("--dtypes", nargs="+", default=["float32"])
    parser.add_argument("--variants", nargs="+", default=["a", "b"])
    out = tmp_path / "grid.json"
    args = parser.parse_args(["--out", str(out)])
    common.run_cell_grid(parser, args, ["--out", str(out)], "benchmarks.no_such_benchmark", {"hidden_size": 8}, len,
                         chunk=4)
    record = json.loads(out.read_text())
    assert record["shape"] == {"hidden_size": 8} and record["summary"] == 2 and "transformers" in record
    assert [(r["dtype"], r["context"], r["variant"]) for r in record["rows"]] == [("float32", 8, "a"),
                                                                                   ("float32", 8, "b")]
    assert capsys.readouterr().out.strip().splitlines()[-1] == "2"  # the rows as they land, then the summary
