"""Every experiment at its --quick size: well-formed results, figures, and resumption; and the
results page counts the experiments there are and has a section for each."""

import json
import os
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from qkmla.cli import main
from qkmla.experiments import EXPERIMENTS, Options, run_experiment
from qkmla.experiments.grid import Run, run_dir, run_grid

ROW_KEYS = {"experiment", "run", "variant", "seed", "lr", "status", "steps", "final_val_loss", "best_val_loss",
            "peak_max_logit", "peak_max_logit_after_clip", "nan_step", "seconds", "median_step_seconds"}
FIGURES = {"lr-sweep": "lr_sweep.png", "qk-clip": "qk_clip.png", "norm-mode": "norm_mode.png",
           "lp-sweep": "lp_sweep.png", "length": "length.png",
           "compression": "compression.png", "retrieval": "retrieval.png", "lp-paper": "lp_paper.png"}


@pytest.fixture(scope="module")
def quick_dir(tmp_path_factory):
    """Every quick experiment in one parent directory (the later ones read lr-sweep's
    best learning rates from the sibling lr-sweep directory, as the full ones do)."""
    root = tmp_path_factory.mktemp("experiments")
    for name in FIGURES:
        run_experiment(EXPERIMENTS[name], Options(root / name, quick=True, workers=2), progress=False,
                       command=f"qkmla experiment {name} --quick")
    return root


@pytest.mark.parametrize("name", list(FIGURES))
def test_quick_experiment_writes_results_and_figure(quick_dir, name):
    out = quick_dir / name
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    planned = EXPERIMENTS[name].plan(Options(out, quick=True))
    assert [r["run"] for r in rows] == [r.name for r in planned]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["experiment"] == name and r["status"] in ("done", "non-finite")
        assert r["seconds"] > 0 and r["peak_max_logit"] > 0
        assert (r["final_val_loss"] is None) == (r["status"] == "non-finite")
    assert (out / FIGURES[name]).read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["command"] == f"qkmla experiment {name} --quick" and summary["runs"] == len(rows)
    assert summary["errors"] == [] and "|---|" in (out / "summary.md").read_text()


def test_experiment_specific_columns(quick_dir):
    lr = {r["run"]: r for r in map(json.loads, (quick_dir / "lr-sweep" / "results.jsonl").read_text().splitlines())}
    clipped = [r for r in lr.values() if r["variant"].startswith("mla-qkclip")]
    assert clipped and all(r["clipped_steps"] is not None for r in clipped)
    assert all((r["peak_max_logit_after_clip"] is not None) == (r["clipped_steps"] > 0) for r in clipped)
    assert any(r["clipped_steps"] > 0 for r in clipped)
    assert all(r["logit_bound"] > 0 for r in lr.values() if "qknorm" in r["variant"])
    clip = [json.loads(x) for x in (quick_dir / "qk-clip" / "results.jsonl").read_text().splitlines()]
    assert all(len(r["curves"]["max_logit"]) > 1 for r in clip)
    length = [json.loads(x) for x in (quick_dir / "length" / "results.jsonl").read_text().splitlines()]
    for r in length:
        assert len(r["position_loss_4x"]) == 4 * r["train_length"] and r["loss_4x_past_train"] > 0
    retrieval = [json.loads(x) for x in (quick_dir / "retrieval" / "results.jsonl").read_text().splitlines()]
    variants = ["mha", "mha-qknorm", "mla", "mla-qknorm", "mla-qknorm-unified"]  # each at both bracket rates
    assert [(r["variant"], r["lr"]) for r in retrieval] == [(v, 3e-3) for v in variants] + [(v, 1e-3) for v in variants]
    assert all(r["key_windows"] == 8 for r in retrieval)
    for r in retrieval:  # MLA variants are also read through compressed latent caches
        assert ("compressed" in r) == r["variant"].startswith("mla")
        if "compressed" in r:
            dense = r["compressed"][0]
            assert len(r["compressed"]) == 14 and (dense["format"], dense["policy"]) == ("dense", None)
            assert abs(dense["key_loss"] - r["key_loss"]) < 1e-4  # through the latent cache = without one
            assert all(c["kept"] < 1 for c in r["compressed"] if c["policy"])
    lp = [json.loads(x) for x in (quick_dir / "lp-sweep" / "results.jsonl").read_text().splitlines()]
    matched = [r for r in lp if r["matched"]]
    assert matched and all(r["initial_scale"] > 0 and r["logit_scale"] > 0 for r in matched)
    paper = [json.loads(x) for x in (quick_dir / "lp-paper" / "results.jsonl").read_text().splitlines()]
    assert [(r["p"], r["lr"]) for r in paper] == [(2.0, 1e-3), (2.0, 3e-3), (4.0, 1e-3), (4.0, 3e-3)]
    for r in paper:  # the validation curve is kept with the row; the scale is learned in log space
        assert [step for step, _ in r["val_curve"]] == [3, 6] and r["val_curve"][-1][1] == r["final_val_loss"]
        run = quick_dir / "lp-paper" / "runs" / r["run"]
        assert json.loads((run / "config.json").read_text())["model"]["logit_scale_param"] == "log"
        logs = [t for k, t in load_file(run / "checkpoint.safetensors").items()
                if k.endswith("parametrizations.logit_scale.original")]
        assert len(logs) == 2 and r["logit_scale"] == pytest.approx(float(sum(t.exp().mean() for t in logs) / 2))


def test_compression_measures_every_setting_against_the_uncompressed_cache(quick_dir):
    from qkmla.experiments.compression import settings

    rows = [json.loads(x) for x in (quick_dir / "compression" / "results.jsonl").read_text().splitlines()]
    assert {r["variant"] for r in rows} == {"mla", "mla-qknorm"}
    for r in rows:
        got = r["settings"]
        assert [(s["format"], s["policy"], s["fraction"]) for s in got] == \
            [(s["format"], s["policy"], s["fraction"]) for s in settings(r["context"])]
        by = {(s["format"], s["policy"], s["fraction"]): s for s in got}
        dense = by[("dense", None, 1.0)]
        # The dense fp32 cache is the reference itself: nothing may change.
        assert dense["loss_delta_rel"] == 0 and dense["top1_agreement"] == 1 and dense["kept"] == 1
        assert dense["bytes_per_token"] == r["reference_bytes_per_token"]
        assert by[("fp8", None, 1.0)]["bytes_per_token"] < by[("bf16", None, 1.0)]["bytes_per_token"] \
            < dense["bytes_per_token"]
        for (fmt, policy, fraction), s in by.items():
            assert 0 <= s["top1_agreement"] <= 1 and 0 <= s["passkey_accuracy"] <= 1
            if policy is not None:  # evicted: fewer tokens than seen, bytes scale with them
                assert s["kept"] < 1
                assert s["effective_bytes_per_token"] == pytest.approx(s["bytes_per_token"] * s["kept"])
        assert r["loss_first_copy"] > 0 and r["loss_second_copy"] > 0 and r["copy_length"] == 28
    summary = json.loads((quick_dir / "compression" / "summary.json").read_text())
    assert set(summary["targets"]) == {f"{m} {f}" for m in ("mla", "mla-qknorm") for f in ("fp8", "int8")}


def test_resume_reruns_nothing_finished(quick_dir):
    out = quick_dir / "norm-mode"
    runs = EXPERIMENTS["norm-mode"].plan(Options(out, quick=True))
    stamps = {r.name: os.stat(run_dir(out, r) / "metrics.jsonl").st_mtime_ns for r in runs}
    assert run_grid(runs, out, workers=1, progress=False) == {}
    # An interrupted run (no final status) is the only one trained again.
    (run_dir(out, runs[0]) / "status.json").unlink()
    trained = run_grid(runs, out, workers=1, progress=False)
    assert list(trained) == [runs[0].name] and trained[runs[0].name]["status"] == "done"
    assert all(os.stat(run_dir(out, r) / "metrics.jsonl").st_mtime_ns == stamps[r.name] for r in runs[1:])


def test_a_changed_plan_trains_again(quick_dir):
    out = quick_dir / "norm-mode"
    run = EXPERIMENTS["norm-mode"].plan(Options(out, quick=True))[1]
    changed = Run(run.name, run.variant, {**run.train, "steps": run.train["steps"] + 1}, run.labels)
    assert list(run_grid([changed], out, workers=1, progress=False)) == [run.name]


def test_a_failing_run_is_reported_and_the_grid_goes_on(tmp_path, capsys):
    good = EXPERIMENTS["norm-mode"].plan(Options(tmp_path, quick=True))[0]
    bad = Run("bad", "bad", {**good.train, "attn": "mla-qknorm", "qk_clip": 10.0})
    statuses = run_grid([bad, good], tmp_path, workers=1, progress=False)
    assert statuses["bad"]["status"] == "error" and "qk_clip" in statuses["bad"]["error"]
    assert statuses[good.name]["status"] == "done"
    assert "run bad failed" in capsys.readouterr().out


def test_a_refill_starts_what_becomes_ready_as_a_worker_comes_free_and_nothing_twice(tmp_path):
    """run_grid's refill (the adaptive grids' scheduler, which re-plans as each run ends): the runs
    it returns start in its order, one per free worker; a run already started in this call (done,
    failed) is not started again; a branch listed once its stretch has finished continues it."""
    first = EXPERIMENTS["norm-mode"].plan(Options(tmp_path, quick=True))[0]
    bad = Run("bad", "bad", {**first.train, "attn": "mla-qknorm", "qk_clip": 10.0})
    branch = Run("branch", "branch", {**first.train, "steps": first.train["steps"] + 2}, start_from=first.name)
    seen = []

    def refill(statuses):
        seen.append(sorted(statuses))
        return [first, bad] + ([branch] if statuses.get(first.name, {}).get("status") == "done" else [])

    statuses = run_grid([first, bad], tmp_path, workers=1, progress=False, refill=refill)
    assert seen == [[first.name], sorted([first.name, "bad"]), sorted([first.name, "bad", "branch"])]
    assert statuses[first.name]["status"] == statuses["branch"]["status"] == "done"
    assert statuses["bad"]["status"] == "error"
    steps = [json.loads(line)["step"] for line in (tmp_path / "runs" / "branch" / "metrics.jsonl").open()
             if '"loss"' in line]
    assert steps == list(range(1, first.train["steps"] + 3))  # the stretch's steps, then its own two


def test_a_refill_that_fails_starts_nothing_new_and_is_raised_once_the_runs_in_flight_end(tmp_path):
    """A refill (the plan, the report) that fails while runs train: the runs in flight end, none
    starts, and the error is raised after them: a full disk as the grid's machine error (its runs'
    statuses kept for the report), anything else as itself. Raised at once, it left the runs in
    flight out of the signal handler's reach while the pool waited for them."""
    import errno

    from qkmla.experiments.grid import GridFailed

    a, b = EXPERIMENTS["norm-mode"].plan(Options(tmp_path, quick=True))
    c = Run("third", "third", {**b.train, "seed": b.train["seed"] + 1})
    for error, kind in ((OSError(errno.ENOSPC, "No space left on device", "results.jsonl"), GridFailed),
                        (ValueError("out: planned badly"), ValueError)):
        out = tmp_path / kind.__name__

        def refill(statuses, error=error):
            raise error

        with pytest.raises(kind) as raised:
            run_grid([a, b, c], out, workers=2, progress=False, refill=refill)
        assert sorted(os.listdir(out / "runs")) == sorted([a.name, b.name])
        assert all(json.loads((out / "runs" / r.name / "status.json").read_text())["status"] == "done" for r in (a, b))
        if kind is GridFailed:
            assert sorted(raised.value.statuses) == sorted([a.name, b.name])


def test_a_stop_names_the_runs_it_stopped_not_every_run_the_grid_ended():
    from qkmla.experiments.grid import GridStopped

    statuses = {"early": {"status": "done", "step": 10}, "late": {"status": "interrupted", "checkpoint_step": 4}}
    assert "early" in str(GridStopped("SIGINT", statuses, 0))
    message = str(GridStopped("SIGINT", statuses, 0, in_flight={"late"}))
    assert "early" not in message and "late (interrupted, checkpoint step 4)" in message


def test_cli_list_and_bad_arguments(tmp_path, capsys, refused):
    assert main(["experiment", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in FIGURES)
    # one column of names, every description after it (qknorm-vs-clip ran into its description)
    starts = {line.index(EXPERIMENTS[line.split()[0]].description) for line in listed.splitlines()}
    assert len(starts) == 1 and all(line.split()[0] in EXPERIMENTS for line in listed.splitlines())
    refused(["experiment", "lr-swep"], "NAME: unknown 'lr-swep'; allowed: lr-sweep")
    refused(["experiment", "lr-sweep", "--seeds", "0"], "--seeds")
    refused(["experiment", "qk-clip", "--sweep", str(tmp_path / "none.jsonl")],
            "--sweep: the results file .*none.jsonl does not exist")
    refused(["experiment", "qk-clip", "--quick", "--out", str(tmp_path / "alone" / "qk-clip")],
            "run `qkmla experiment lr-sweep --quick")
    not_a_sweep = tmp_path / "not-a-sweep.jsonl"
    not_a_sweep.write_text("{not json\n")
    refused(["experiment", "qk-clip", "--quick", "--sweep", str(not_a_sweep), "--out", str(tmp_path / "q")],
            f"--sweep: {not_a_sweep} holds no lr-sweep results")
    other_rows = tmp_path / "other-rows.jsonl"  # JSON lines, but not an lr-sweep's
    other_rows.write_text(json.dumps({"run": "x", "status": "done"}) + "\n")
    refused(["experiment", "qk-clip", "--quick", "--sweep", str(other_rows), "--out", str(tmp_path / "q2")],
            r"holds no lr-sweep results with .* runs \(its rows have no 'variant' field\)")
    default = tmp_path / "d" / "lr-sweep" / "results.jsonl"  # --sweep's default beside --out, not typed
    default.parent.mkdir(parents=True)
    default.write_text("{not json\n")
    refused(["experiment", "qk-clip", "--quick", "--out", str(tmp_path / "d" / "qk-clip")],
            re.escape(f"--sweep (not given; its default is OUT/../lr-sweep/results.jsonl): {default} holds no lr-sweep"))


def test_the_sweep_help_names_the_experiments_that_read_it():
    """--sweep's help lists its readers as a literal (the parser does not import the experiments);
    this keeps the literal equal to the experiments' own reads_sweep."""
    from qkmla.cli.commands import build_parser

    experiment = build_parser()._subparsers._group_actions[0].choices["experiment"]
    sweep = next(a for a in experiment._actions if "--sweep" in a.option_strings)
    listed = re.search(r"at it \(([^;]+);", sweep.help).group(1).split(", ")
    assert listed == sorted(name for name, e in EXPERIMENTS.items() if e.reads_sweep)


def test_finished_runs_archived_by_redraw_are_restored_and_not_trained_again(tmp_path):
    from qkmla.experiments.grid import ARCHIVED, archive_runs, restore_runs

    out = tmp_path / "grid"
    for name, status in (("a", "done"), ("b", "running")):
        run = out / "runs" / name
        run.mkdir(parents=True)
        (run / "status.json").write_text(json.dumps({"status": status}))
        for f in ("config.json", "metrics.jsonl", "measure.json", "numerics.json"):
            (run / f).write_text(f"{name} {f}")
        (run / "checkpoint.safetensors").write_bytes(b"x" * 10)
    published = tmp_path / "published"
    assert archive_runs(out, published) == ["a"]
    assert sorted(p.name for p in (published / "runs" / "a").iterdir()) == sorted(ARCHIVED)
    fresh = tmp_path / "next-session"
    assert restore_runs(published, fresh) == ["a"]
    assert (fresh / "runs" / "a" / "metrics.jsonl").read_text() == "a metrics.jsonl"
    assert restore_runs(published, fresh) == []  # an existing directory is never replaced


def test_the_results_page_counts_every_experiment_and_gives_each_a_section():
    page = (Path(__file__).resolve().parents[2] / "docs" / "results.md").read_text()
    words = dict(enumerate("Nine Ten Eleven Twelve Thirteen Fourteen Fifteen".split(), start=9))
    first = page.split("\n\n")[1]  # the paragraph under the title
    assert first.startswith(f"{words[len(EXPERIMENTS)]} experiments"), first[:80]
    sections = re.findall(r"^## ([a-z0-9-]+): ", page, re.M)
    assert sorted(set(EXPERIMENTS) - set(sections)) == [], "an experiment without its section on the page"
