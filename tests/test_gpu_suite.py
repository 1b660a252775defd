"""The GPU suite (benchmarks/gpu/) on the CPU: its dry run goes through every part's code at
tiny shapes (the kernel in Triton's interpreter) and writes result files of the shape the
real run writes; a part that fails or runs out of time keeps its rows and the next part runs;
results are never replaced without --overwrite. The figures themselves are not asserted."""

import importlib
import importlib.util
import json
import math
import re

import pytest


def load(name: str):
    """The suite's module ``benchmarks.gpu.<name>``."""
    return importlib.import_module(f"benchmarks.gpu.{name}")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of every part, shared by the tests that read its files."""
    run = load("run")
    out = tmp_path_factory.mktemp("gpu") / "dry"
    rc = run.main(["--dry-run", "--out", str(out)])
    return rc, out, {p.name: json.loads((out / f"{i}_{p.name}.json").read_text()) for i, p in enumerate(run.PARTS, 1)}


def test_dry_run_runs_every_part_and_writes_the_summary(dry_run):
    rc, out, records = dry_run
    assert rc == 0, {name: (r["status"], r.get("error")) for name, r in records.items()}
    expected = {name: "ok" for name in records}
    if importlib.util.find_spec("torchtitan") is None:  # its dry run: tests/integrations/torchtitan/test_gpu_part.py
        expected["torchtitan"] = "skipped"
        assert "torchtitan is not installed here" in records["torchtitan"]["reason"]
    if importlib.util.find_spec("vllm") is None:  # its dry run: tests/integrations/vllm/test_gpu_part.py
        expected["vllm"] = "skipped"
        assert "vllm is not installed here" in records["vllm"]["reason"]
    for name, r in records.items():
        assert r["status"] == expected[name], json.dumps(r)[-4000:]
        assert r["part"] == name and r["dry_run"] is True and r["seconds"] > 0 and r["wall_seconds"] > 0
        assert r["command"].startswith("python -m benchmarks.gpu.run --dry-run --out ")
        assert r["commit"] is None or re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", r["commit"])
        assert {"torch", "torch_cuda", "triton", "python", "cpu"} <= set(r["environment"])
        assert (out / f"{list(records).index(name) + 1}_{name}.log").is_file()
    index = json.loads((out / "suite.json").read_text())["parts"]
    assert {name: p["status"] for name, p in index.items()} == expected
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# qkmla GPU suite: CPU") and "**Dry run**" in summary
    # "commits" when the checkout moved on between parts (other work committed during the run)
    assert re.search(r"^- commits?: ", summary, re.M) and "Triton " in summary and "torch " in summary
    for i, name in enumerate(records, 1):
        assert f"## {i}. {name}" in summary
    assert not list(out.glob("*.tmp[0-9]*"))  # every file was renamed into place (qkmla.utils.files' temporary name)


def test_the_cuda_tests_are_the_marked_ones_and_run_without_pytest_xdist():
    """Part 1 collects only the files with tests marked ``cuda`` (not the fault table, whose device
    rows are refusals), and its pytest runs on a GPU image that has pytest but not pytest-xdist."""
    import subprocess
    import sys

    part = load("part_correctness")
    files = part.cuda_test_files()
    assert {"tests/ops/test_mla_decode.py", "tests/ops/test_mla_decode_backends.py",
            "tests/integrations/vllm/test_backend.py"} <= set(files) and "tests/cli/test_faults.py" not in files
    proc = subprocess.run([sys.executable, "-m", "pytest", "-o", "addopts=--import-mode=importlib", "-p", "no:xdist",
                           "-p", "no:cacheprovider", "-q", "--collect-only", "-m", part.CUDA_MARKER,
                           "tests/ops/test_mla_decode.py"], cwd=part.REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and " deselected" not in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_dry_run_correctness_checks_every_value_of_every_axis(dry_run):
    _, out, records = dry_run
    r = records["correctness"]
    part = load("part_correctness")
    assert r["checks_failed"] == 0
    tests = r["tests"]
    assert tests["status"] == "ok" and tests["counts"]["tests"] >= 1 and tests["counts"]["failures"] == 0
    assert set(tests["files"]) == set(part.cuda_test_files()) and "tests/ops/test_mla_decode.py" in tests["files"]
    assert (out / "1_correctness_pytest.xml").is_file()
    rows = r["kernel"]["rows"]
    assert r["kernel"]["passed"] == len(rows) == r["kernel"]["cases"] and r["kernel"]["not_run"] == 0
    axes = {"heads": part.DRY["heads"], "page": part.DRY["pages"], "s_q": (1, 2), "kv_format": part.FORMATS,
            "norm": tuple(part.NORMS)}
    for axis, values in axes.items():
        assert {row[axis] for row in rows} == set(values), axis
    vllm_rows = [row for row in rows if row["layout"] == "row"]  # the scalars inside vLLM's cache rows
    assert {(row["heads"], row["norm"]) for row in vllm_rows} == {(H, n) for H in part.DRY["heads"]
                                                                  for n in ("blockwise", "unified")}
    assert {row["page"] for row in vllm_rows} == set(part.DRY["pages"])
    assert {row["kv_format"] for row in vllm_rows} == {"dense"} and {row["layout"] for row in rows} == {"apart", "row"}
    for row in rows:
        assert row["nan_free"] and row["kernel_err"] <= row["err_budget"] and row["lse_err"] <= row["lse_budget"]
    steps = r["compiled_step"]["rows"]
    assert [s["batch"] for s in steps] == [1, 4] and all(s["passed"] for s in steps)


def test_dry_run_kernel_rows_and_bytes(dry_run):
    _, out, records = dry_run
    r = records["kernel"]
    summary = (out / "summary.md").read_text()
    part = load("part_kernel")
    shape = part.DRY
    variants = {v for v, *_ in part.KERNEL_VARIANTS} | {v for v, _ in part.COMPILE_VARIANTS}
    by = {(x["heads"], x["context"], x["batch"], x["variant"]): x for x in r["rows"]}
    assert set(by) == {c + (v,) for c in part.configs(shape) for v in variants}
    assert any(batch > 1 for _, _, batch in part.configs(shape))  # the many-token batch is in the dry run too
    fp8_row = shape["d_c"] + 4 + 2 * shape["d_r"]  # codes, one float32 scale (d_c < 128), the bf16 RoPE key
    for (H, context, batch), tokens in {c: c[1] * c[2] for c in part.configs(shape)}.items():
        row = lambda v: by[(H, context, batch, v)]  # noqa: E731
        assert row("kernel-mla")["bytes"] == tokens * 2 * (shape["d_c"] + shape["d_r"])
        assert row("kernel-qknorm")["bytes"] == row("kernel-mla")["bytes"] + tokens * 2 * H
        assert row("kernel-mla-fp8")["bytes"] == tokens * fp8_row
        assert row("compile-qknorm")["bytes"] == row("kernel-qknorm")["bytes"]
        assert row("kernel-qknorm-vllm-row")["bytes"] == row("kernel-qknorm")["bytes"]  # the same bytes, one tensor
        assert row("kernel-qknorm-vllm-row")["layout"] == "row" and row("kernel-qknorm")["layout"] == "apart"
        assert row("kernel-qknorm")["launch"]["num_splits"] == 1 and row("kernel-qknorm")["timing"] == "eager"
        for v in variants:
            assert row(v)["us"] > 0 and math.isclose(row(v)["gb_per_s"], row(v)["bytes"] / row(v)["us"] / 1e3)
            assert row(v)["roofline_pct"] is None  # no datasheet peak off a GPU
    # every distinct launch configuration, per head count, with the launcher's own kernel
    from qkmla.ops.mla_decode.triton_kernel import LAUNCH_CONFIGS, launch_config

    for H in shape["heads"]:
        rows = [x for x in r["config_rows"] if x["heads"] == H]
        launches = {tuple(launch_config(H, 1, 64, "cpu", i, 1)[k] for k in ("BLOCK_H", "BLOCK_N", "num_warps",
                                                                          "num_stages"))
                    for i in range(len(LAUNCH_CONFIGS))}
        assert len(rows) == len(part.CONFIG_VARIANTS) * len(launches)
        assert all(x["us"] > 0 and not {"error", "does_not_fit", "not_run"} & set(x) for x in rows)
        assert {x["variant"] for x in rows} == {v for v, *_ in part.CONFIG_VARIANTS}
        assert {x["kv_format"] for x in rows} == {"dense", "fp8", "int8"}
    assert "**Launch configurations**" in summary
    for d in r["derived"]:
        assert math.isclose(d["byte_bound_pct"], 100 * d["heads"] / (shape["d_c"] + shape["d_r"]))
        q, p = by[(d["heads"], d["context"], d["batch"], "kernel-qknorm")], by[(d["heads"], d["context"], d["batch"],
                                                                               "kernel-mla")]
        assert math.isclose(d["qknorm_overhead_pct"], 100 * (q["us"] / p["us"] - 1))
        v = by[(d["heads"], d["context"], d["batch"], "kernel-qknorm-vllm-row")]
        assert math.isclose(d["qknorm_overhead_pct_vllm_row"], 100 * (v["us"] / p["us"] - 1))
        assert d["kernel_over_compile_qknorm"] > 0 and d["fp8_over_bf16_bytes_qknorm"] < 1
    assert r["kernel_autotuned"] is False and r["copy_bytes_per_s"] > 0
    assert {t["met"] for t in r["targets"].values()} == {None}  # evaluated only on a GPU
    assert "vllm_row_qknorm_within_extra_bytes_plus_2pct" in r["targets"]


def test_dry_run_model_decode_training_and_qk_clip_rows(dry_run):
    _, _, records = dry_run
    rows = records["model_decode"]["rows"]
    variants = {r["variant"] for r in rows}
    assert {"latent-compiled", "latent-eager", "fullkv-eager", "hf-unpatched", "hf-latent"} == variants
    for r in rows:
        assert r.get("tokens_per_s", 0) > 0 or r.get("skipped"), r  # hf-latent: a recorded reason while it is missing
    compiled = [r for r in rows if r["variant"] == "latent-compiled"]
    assert compiled and all(r["max_abs_diff_to_eager"] < 1e-3 for r in compiled)

    train = records["training"]["rows"]
    assert {(r["mode"], r["variant"]) for r in train} == {(m, v) for m in ("eager", "compiled")
                                                          for v in ("mla", "mla-qknorm")}
    for r in train:
        assert r["tokens_per_s"] > 0 and any("scaled_dot_product" in k for k in r["sdpa_kernels"])
        if r["variant"] == "mla":
            assert r["ratio_to_mla"] == 1.0

    clip = records["qk_clip"]
    part = load("part_qk_clip")
    names = set(part.variants(part.DRY["tau"]))
    assert {r["variant"] for r in clip["rows"]} == names and "mla-qkclip-0.05" in names
    for r in clip["rows"]:
        assert r["steps"] == part.DRY["max_steps"] and math.isfinite(r["val_loss"]) and r["error"] is None
        if r["variant"] == "mla-qkclip-0.05":  # the dry run's tau is reached: the clip and its measurement ran
            assert r["clipped_steps"] >= 1 and r["peak_max_logit_after_clip"] > 0
        else:
            assert r["clipped_steps"] is None and r["peak_max_logit_after_clip"] is None
    assert set(clip["best_lr_at_horizon"]) == names


def test_the_kernel_targets_on_a_gpu_name_the_shapes_that_miss():
    """On a GPU each target is met or missed with the shapes that miss it; the serving target
    reads the QK-norm kernel over vLLM's rows against plain with 2% beside the byte bound."""
    part = load("part_kernel")

    def shape(context, plain_us, apart_us, row_us):
        base = dict(heads=16, context=context, batch=1, tokens=context, roofline_pct=90.0)
        rows = [dict(base, variant="kernel-mla", us=plain_us, bytes=1152 * context),
                dict(base, variant="kernel-qknorm", us=apart_us, bytes=1184 * context),
                dict(base, variant="kernel-qknorm-vllm-row", us=row_us, bytes=1184 * context)]
        return rows

    rows = shape(4096, 100.0, 103.0, 104.0) + shape(8192, 200.0, 205.0, 210.0)
    t = part.targets(rows, part.derived(rows), fill_tokens=8192, on_gpu=True)
    # byte bound 2.78%: +3% is within it plus 1%, +2.5% too; +4% is within it plus 2%, +5% is not
    assert t["qknorm_overhead_within_byte_bound_plus_1pct"] == {"met": True, "misses": []}
    assert t["vllm_row_qknorm_within_extra_bytes_plus_2pct"] == {"met": False, "misses": ["16h 8192 x1"]}
    assert t["roofline_80pct_at_1M_tokens"]["met"] is True
    assert part.targets(rows, part.derived(rows), 8192, on_gpu=False)["vllm_row_qknorm_within_extra_bytes_plus_2pct"] \
        == {"met": None, "misses": []}


def test_the_covering_subset_comes_first():
    suite = load("suite")
    axes = {"a": [1, 2], "b": ["x", "y", "z"], "c": [True]}
    cases = suite.covering_first(axes)
    assert len(cases) == 6 and len({tuple(c.values()) for c in cases}) == 6  # every combination, once
    first = cases[:3]
    assert first == suite.covering(axes)
    for name, values in axes.items():
        assert {c[name] for c in first} == set(values)


def test_parts_out_of_time_record_what_they_did_not_run(tmp_path):
    """With no time left, a part starts nothing more and says so (the deadline branches)."""
    run = load("run")
    out = tmp_path / "out"
    assert run.main(["--dry-run", "--out", str(out), "--parts", "kernel", "training", "--budget-min", "0.01"]) == 0
    kernel = json.loads((out / "2_kernel.json").read_text())
    training = json.loads((out / "4_training.json").read_text())
    assert kernel["status"] == training["status"] == "partial"
    part = load("part_kernel")  # a 1-second budget: no shape fits (each needs 15 s in reserve)
    assert kernel["rows"] == [] and kernel["config_rows"] == []
    assert len(kernel["not_run"]) == 2 * len(part.configs(part.DRY)) + len(part.DRY["heads"])
    assert kernel["copy_bytes_per_s"] > 0 and {t["met"] for t in kernel["targets"].values()} == {None}
    assert training["rows"] == [] and len(training["not_run"]) == 2
    summary = (out / "summary.md").read_text()
    assert "not run (out of time)" in summary and "## 2. kernel" in summary and "## 4. training" in summary


FAKE_PARTS = {
    "crash": "import os\ndef run(ctx):\n    ctx.record['rows'] = [1]\n    ctx.save()\n    os._exit(3)\n",
    "boom": "def run(ctx):\n    ctx.record['rows'] = [1, 2]\n    ctx.save()\n    raise ValueError('boom')\n",
    "slow": "import time\ndef run(ctx):\n    ctx.record['rows'] = [1]\n    ctx.save()\n    time.sleep(600)\n",
    "fine": "def run(ctx):\n    ctx.record['rows'] = ['done']\n",
}


def fake_parts(run, tmp_path):
    parts = []
    for name, code in FAKE_PARTS.items():
        module = tmp_path / f"part_{name}.py"
        module.write_text(code + "def summarize(record):\n    return [f'rows: {record.get(\"rows\")}']\n")
        parts.append(run.Part(name, module, 1.0))
    return tuple(parts)


def test_a_failing_or_late_part_keeps_its_rows_and_the_suite_goes_on(tmp_path):
    run = load("run")
    out = tmp_path / "out"
    parts = fake_parts(run, tmp_path)
    # 0.2 min over 4 parts: about 3 s each, and 6 s of grace for the slow one before it is killed
    assert run.main(["--dry-run", "--out", str(out), "--budget-min", "0.2"], parts=parts, grace_s=6.0) == 1
    got = {p.name: json.loads((out / f"{i}_{p.name}.json").read_text()) for i, p in enumerate(parts, 1)}
    assert got["crash"]["status"] == "failed" and "exited with code 3" in got["crash"]["error"]
    assert got["crash"]["rows"] == [1]
    assert got["boom"]["status"] == "failed" and got["boom"]["error"] == "ValueError: boom"
    assert got["boom"]["rows"] == [1, 2] and "Traceback" in got["boom"]["traceback"]
    assert got["slow"]["status"] == "timeout" and got["slow"]["rows"] == [1]
    assert got["fine"]["status"] == "ok" and got["fine"]["rows"] == ["done"]
    summary = (out / "summary.md").read_text()
    for name, status in (("crash", "failed"), ("boom", "failed"), ("slow", "timeout"), ("fine", "ok")):
        assert re.search(rf"\| \d {name} \| {status} \|", summary), (name, summary)
    assert "rows: ['done']" in summary and "ValueError: boom" in summary


def test_a_part_s_results_are_refused_without_overwrite_and_others_are_kept(tmp_path, capsys):
    """Parts may be run by several commands into one directory (a machine that allows 10 minutes
    per command); results of the chosen parts are replaced only with --overwrite, others never."""
    run = load("run")
    out = tmp_path / "out"
    out.mkdir()
    (out / "1_fine.json").write_text('{"part": "fine", "status": "ok", "rows": ["earlier"]}\n')
    (out / "notes.txt").write_text("not ours\n")
    parts = fake_parts(run, tmp_path)[-1:] + (run.Part("also", tmp_path / "part_fine.py", 1.0),)
    with pytest.raises(SystemExit) as e:
        run.main(["--dry-run", "--out", str(out), "--parts", "fine"], parts=parts)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--out" in err and "--overwrite" in err and "1_fine.json" in err
    assert "earlier" in (out / "1_fine.json").read_text() and not (out / "summary.md").exists()

    assert run.main(["--dry-run", "--out", str(out), "--parts", "also", "--budget-min", "0.2"], parts=parts) == 0
    assert "earlier" in (out / "1_fine.json").read_text()  # another part's results: untouched
    summary = (out / "summary.md").read_text()
    assert "## 1. fine" in summary and "## 2. also" in summary and "rows: ['earlier']" in summary

    assert run.main(["--dry-run", "--out", str(out), "--parts", "fine", "--overwrite", "--budget-min", "0.2"],
                    parts=parts) == 0
    assert sorted(p.name for p in out.iterdir()) == ["1_fine.json", "1_fine.log", "2_also.json", "2_also.log",
                                                     "notes.txt", "suite.json", "summary.md"]
    assert "earlier" not in (out / "1_fine.json").read_text()
    (out / "summary.md").unlink()
    assert run.main(["--summarize", str(out)], parts=parts) == 0  # rebuilt from the part files alone
    assert (out / "summary.md").read_text().count("rows: ['done']") == 2
    assert json.loads((out / "suite.json").read_text())["parts"]["also"]["status"] == "ok"


@pytest.mark.parametrize("argv,pattern", [
    (["--budget-min", "0"], "--budget-min: expected a positive number"),
    (["--budget-min", "nan"], "--budget-min: expected a positive number"),
    (["--parts", "kernel", "speed"], r"--parts: expected distinct names of \['correctness'"),
    (["--parts", "kernel", "kernel"], "--parts: expected distinct names"),
    (["--wheels", "/nonexistent/wheels"], "--wheels: /nonexistent/wheels is not a directory"),
    (["--summarize", "/nonexistent/results"], "--summarize: no part results"),
])
def test_bad_arguments_are_refused_before_any_work(argv, pattern, tmp_path, capsys):
    run = load("run")
    with pytest.raises(SystemExit) as e:
        run.main(["--dry-run", "--out", str(tmp_path / "out"), *argv])
    assert e.value.code == 2 and re.search(pattern, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()


def test_the_configuration_sweep_records_what_does_not_fit_fails_or_runs_out_of_time(tmp_path, monkeypatch):
    """A configuration Triton refuses is "does not fit", any other failure is an error, and with
    no time left the rest are "not run"; the other configurations are still timed."""
    import torch
    from triton.runtime.errors import OutOfResources

    from qkmla.ops.mla_decode import triton_kernel

    suite, part = load("suite"), load("part_kernel")
    real = triton_kernel.mla_decode_fwd

    def some_refused(*args, launch_index=None, **kwargs):
        if launch_index == 1:
            raise OutOfResources(300_000, 232_448, "shared memory")
        if launch_index == 2:
            raise RuntimeError("a compile error")
        return real(*args, launch_index=launch_index, **kwargs)
    monkeypatch.setattr(triton_kernel, "mla_decode_fwd", some_refused)

    def context(budget_s):
        ctx = suite.PartContext("kernel", tmp_path / "k.json", True, budget_s, torch.device("cpu"))
        ctx.record.update(peak_bytes_per_s=None, copy_bytes_per_s=1e9, config_rows=[], shape=part.DRY)
        return ctx
    rows = part.config_rows(context(600.0), part.DRY, 4)
    by = {}
    for r in rows:
        by.setdefault(r["launch"]["config"], []).append(r)
    assert all(r["us"] > 0 for r in by[0])
    assert all("shared memory" in r["does_not_fit"] for r in by[1])
    assert all(r["error"] == "RuntimeError: a compile error" for r in by[2])
    lines = "\n".join(part.summarize({"config_rows": rows}))
    assert "does not fit" in lines and "error" in lines
    late = part.config_rows(context(0.0), part.DRY, 4)
    assert late and all(r["not_run"] == "out of time" for r in late)
    assert "not run" in "\n".join(part.summarize({"config_rows": late}))
