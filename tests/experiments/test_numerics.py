"""A chain of runs stays one trajectory: what numerics a run recorded, which runs a chain
supersedes when its stretches ran under other numerics, and the worker's guard."""

import json

import pytest
import torch

from qkmla.experiments.grid import Run, archive_runs, restore_runs
from qkmla.experiments.numerics import (
    FILENAME,
    SUPERSEDED,
    check_continues,
    cpu_id,
    numerics,
    record,
    roundoff,
    recorded,
    supersede_other_trajectories,
)
from qkmla.train.checkpoint import FILENAME as CHECKPOINT

HERE = {"torch": "2.13.0+cpu", "cpu_capability": "AVX2", "threads": 1}
ELSEWHERE = {"torch": "2.13.0+cpu", "cpu_capability": "AVX512", "threads": 1}


def _chain() -> list[Run]:
    """stable8 -> h10, stable8 -> stable16 -> h20: two horizons of one warmup-stable-decay run (named with a
    dot, as the grids' runs are: lr0.005_s1000_stable480)."""
    return [Run("lr0.5_stable8", "mla", {}), Run("lr0.5_h10", "mla", {}, start_from="lr0.5_stable8"),
            Run("lr0.5_stable16", "mla", {}, start_from="lr0.5_stable8"),
            Run("lr0.5_h20", "mla", {}, start_from="lr0.5_stable16")]


def _run(out, name, status="done", numerics_=None, checkpoint=False):
    path = out / "runs" / name
    path.mkdir(parents=True)
    if status is not None:
        (path / "status.json").write_text(json.dumps({"status": status}))
    (path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}\n')
    if numerics_ is not None:
        record(path, numerics_)
    if checkpoint:
        (path / CHECKPOINT).write_bytes(b"")
    return path


def test_numerics_names_what_decides_the_rounding():
    now = numerics()
    assert now == {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                   "cpu_id": cpu_id(), "roundoff": roundoff(torch.get_num_threads()),
                   "threads": torch.get_num_threads()}
    assert numerics(1)["threads"] == 1 and numerics(1)["roundoff"] == roundoff(1)
    assert all(isinstance(v, str) and len(v) == 16 for v in (now["cpu_id"], now["roundoff"]))


def test_the_roundoff_probe_is_the_bits_of_its_products_on_its_threads():
    """The probe reads the same bits on every call (a chain compares it across processes), leaves
    the thread count as it found it, and changes when a product's bits change."""
    import subprocess
    import sys

    before = torch.get_num_threads()
    first = roundoff.__wrapped__(1)
    assert torch.get_num_threads() == before and roundoff.__wrapped__(1) == first
    code = "from qkmla.experiments.numerics import roundoff; print(roundoff(1))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == first
    real = torch.nn.functional.linear
    try:
        torch.nn.functional.linear = lambda x, w: torch.nextafter(real(x, w), torch.tensor(float("inf")))
        assert roundoff.__wrapped__(1) != first  # one ulp in one product is another rounding
    finally:
        torch.nn.functional.linear = real


def test_a_record_of_the_instruction_set_alone_is_other_numerics(tmp_path):
    """Runs recorded before the record held the CPU's identity and roundoff (only torch, instruction
    set and threads) are not taken as this machine's: an AVX-512 CPU is not every AVX-512 CPU."""
    old = {k: v for k, v in numerics(1).items() if k in ("torch", "cpu_capability", "threads")}
    out = tmp_path / "g"
    _run(out, "lr0.5_stable8", numerics_=old)
    _run(out, "lr0.5_h10", numerics_=old)
    moved = supersede_other_trajectories(_chain(), out, numerics(1))
    assert moved == ["lr0.5_stable8", "lr0.5_h10"]


def test_a_record_reads_back_and_a_missing_or_broken_one_is_told_apart(tmp_path):
    record(tmp_path, HERE)
    assert recorded(tmp_path) == HERE
    assert recorded(tmp_path / "none") == {"recorded": False}
    (tmp_path / FILENAME).write_text("[1, 2")
    assert recorded(tmp_path) == {"recorded": "unreadable"} != recorded(tmp_path / "none")


def test_a_finished_chain_stays_as_it_ran_under_any_numerics(tmp_path):
    for name in ("lr0.5_stable8", "lr0.5_h10", "lr0.5_stable16", "lr0.5_h20"):
        _run(tmp_path, name)  # before runs recorded their numerics
    assert supersede_other_trajectories(_chain(), tmp_path, HERE) == []
    assert not (tmp_path / SUPERSEDED).exists()


def test_a_branch_from_another_trajectory_is_superseded_and_kept(tmp_path):
    """The committed case: the stable stretches trained again here (their checkpoints were lost
    with the machine), so the 600-step branch trained from the old stable480 is another trajectory."""
    _run(tmp_path, "lr0.5_stable8", numerics_=HERE, checkpoint=True)
    _run(tmp_path, "lr0.5_h10")  # unrecorded: trained elsewhere, before runs recorded their numerics
    _run(tmp_path, "lr0.5_stable16", status="stopped", numerics_=HERE, checkpoint=True)  # half-way, here
    assert supersede_other_trajectories(_chain(), tmp_path, HERE) == ["lr0.5_h10"]
    kept = tmp_path / SUPERSEDED / "lr0.5_h10"
    assert (kept / "status.json").is_file() and (kept / "metrics.jsonl").is_file()
    why = json.loads((kept / "superseded.json").read_text())
    assert why["run"] == "lr0.5_h10" and "unrecorded" in why["why"] and why["numerics_now"] == HERE
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["lr0.5_stable16", "lr0.5_stable8"]
    assert supersede_other_trajectories(_chain(), tmp_path, HERE) == []  # settled


def test_a_chain_to_grow_trains_again_from_its_start_under_these_numerics(tmp_path):
    _run(tmp_path, "lr0.5_stable8", numerics_=ELSEWHERE)
    stable8 = tmp_path / "runs" / "lr0.5_stable8"
    (stable8 / "status.json").replace(stable8 / "status.no-checkpoint.json")
    _run(tmp_path, "lr0.5_h10", numerics_=ELSEWHERE)
    _run(tmp_path, "lr0.5_stable16", numerics_=ELSEWHERE)  # finished, but h20 is not: the chain grows
    moved = supersede_other_trajectories(_chain(), tmp_path, HERE)
    assert moved == ["lr0.5_stable8", "lr0.5_h10", "lr0.5_stable16"]
    # the run marked to train again for its lost checkpoint is kept as it finished
    assert json.loads((tmp_path / SUPERSEDED / "lr0.5_stable8" / "status.json").read_text())["status"] == "done"
    why = [json.loads((tmp_path / SUPERSEDED / n / "superseded.json").read_text())["why"] for n in moved]
    assert "AVX512" in why[0] and "checkpoint" in why[0] and "lr0.5_stable8" in why[1] and "lr0.5_stable8" in why[2]


def test_a_run_begun_under_other_numerics_starts_over_and_a_second_copy_gets_a_new_name(tmp_path):
    _run(tmp_path, "lr0.5_stable8", status="stopped", numerics_=ELSEWHERE, checkpoint=True)
    assert supersede_other_trajectories(_chain(), tmp_path, HERE) == ["lr0.5_stable8"]
    _run(tmp_path, "lr0.5_stable8", status="stopped", numerics_=ELSEWHERE, checkpoint=True)
    assert supersede_other_trajectories(_chain(), tmp_path, HERE) == ["lr0.5_stable8"]
    assert (tmp_path / SUPERSEDED / "lr0.5_stable8.2" / "superseded.json").is_file()
    # a directory with nothing trained yet stays, whatever its record
    _run(tmp_path, "lr0.5_stable8", status=None, numerics_=ELSEWHERE)
    (tmp_path / "runs" / "lr0.5_stable8" / "metrics.jsonl").unlink()
    assert supersede_other_trajectories(_chain(), tmp_path, HERE) == []


def test_the_same_numerics_keep_a_branch_whose_parent_trains_again(tmp_path):
    """Under one numerics a stretch trained again repeats its steps, so its branches stay."""
    _run(tmp_path, "lr0.5_stable8", numerics_=HERE)
    stable8 = tmp_path / "runs" / "lr0.5_stable8"
    (stable8 / "status.json").replace(stable8 / "status.no-checkpoint.json")
    _run(tmp_path, "lr0.5_h10", numerics_=HERE)
    _run(tmp_path, "lr0.5_stable16", status="interrupted", numerics_=HERE, checkpoint=True)
    assert supersede_other_trajectories(_chain(), tmp_path, HERE) == []


def test_the_worker_records_its_numerics_and_refuses_to_mix_them(tmp_path):
    run, parent = tmp_path / "run", tmp_path / "parent"
    run.mkdir()
    check_continues(run, None, HERE)
    assert recorded(run) == HERE
    (run / CHECKPOINT).write_bytes(b"")
    with pytest.raises(ValueError, match=r"numerics: .*run was begun under .*AVX2.* would continue under .*AVX512.*; "
                                         r"remove it \(or move it away, or remove its checkpoint.safetensors\)"):
        check_continues(run, None, ELSEWHERE, resume=True)
    check_continues(run, None, ELSEWHERE)  # a run that starts over (another config, say) is not checked
    assert recorded(run) == ELSEWHERE
    parent.mkdir()
    record(parent, ELSEWHERE)
    branch = tmp_path / "branch"
    branch.mkdir()
    with pytest.raises(ValueError, match=r"numerics: .*parent ran under .*AVX512.*branch branch"):
        check_continues(branch, parent, HERE)
    assert not (branch / FILENAME).exists()


def test_the_archive_keeps_superseded_runs_beside_the_runs_that_replace_them(tmp_path):
    out, published = tmp_path / "grid", tmp_path / "published"
    _run(out, "lr0.5_stable8", numerics_=HERE, checkpoint=True)
    _run(out, "lr0.5_h10")
    _run(out, "lr0.5_stable16", numerics_=HERE)
    archive_runs(out, published)  # the archive as committed before h10 was superseded
    assert (published / "runs" / "lr0.5_h10" / "status.json").is_file()
    assert (published / "runs" / "lr0.5_stable8" / FILENAME).is_file()
    supersede_other_trajectories(_chain(), out, HERE)
    assert archive_runs(out, published) == ["lr0.5_stable16", "lr0.5_stable8"]
    assert not (published / "runs" / "lr0.5_h10").exists()  # its stale copy is gone from runs/ ...
    assert (published / SUPERSEDED / "lr0.5_h10" / "superseded.json").is_file()  # ... and kept here
    _run(out, "lr0.5_h10", numerics_=HERE)  # trained again
    archive_runs(out, published)
    assert recorded(published / "runs" / "lr0.5_h10") == HERE and (published / SUPERSEDED / "lr0.5_h10").is_dir()
    fresh = tmp_path / "fresh"
    assert restore_runs(published, fresh) == ["lr0.5_h10", "lr0.5_stable16", "lr0.5_stable8"]
    assert recorded(fresh / "runs" / "lr0.5_h10") == HERE and not (fresh / SUPERSEDED).exists()


def test_a_chain_that_ended_in_a_divergence_is_finished(tmp_path):
    """Review 16a B1: a non-finite stretch is continued by nothing, so its missing branches do not make its chain
    grow: under other numerics it stays as it ran (it was superseded and trained again, its divergence replaced)."""
    _run(tmp_path, "lr0.5_stable8", status="non-finite")
    assert supersede_other_trajectories(_chain(), tmp_path, HERE) == []
    _run(tmp_path, "lr0.5_h10")
    (tmp_path / "runs" / "lr0.5_stable8" / "status.json").write_text(json.dumps({"status": "done"}))
    _run(tmp_path, "lr0.5_stable16", status="non-finite")
    assert supersede_other_trajectories(_chain(), tmp_path, HERE) == []


def test_a_second_supersede_of_a_name_keeps_the_first_in_the_archive(tmp_path):
    """Review 16a B2: a fresh grid restored from the archive has no superseded/, so a run superseded again took
    the name of the one already archived, and archive_runs wrote over it."""
    out, published = tmp_path / "grid", tmp_path / "published"
    _run(out, "lr0.5_stable8", numerics_=ELSEWHERE)
    supersede_other_trajectories(_chain(), out, HERE)  # h10 missing: the chain grows, stable8 goes
    archive_runs(out, published)
    fresh = tmp_path / "fresh"
    _run(fresh, "lr0.5_stable8", numerics_={**HERE, "torch": "2.14.0+cpu"})
    supersede_other_trajectories(_chain(), fresh, HERE)
    archive_runs(fresh, published)
    archive_runs(fresh, published)  # a redraw again copies onto the same entry, not a third
    kept = sorted(p.name for p in (published / SUPERSEDED).iterdir())
    assert kept == ["lr0.5_stable8", "lr0.5_stable8.2"]
    recorded_then = [json.loads((published / SUPERSEDED / k / "superseded.json").read_text())["numerics_recorded"]
                     for k in kept]
    assert recorded_then == [ELSEWHERE, {**HERE, "torch": "2.14.0+cpu"}]


def test_an_archived_run_replaced_by_a_new_one_keeps_none_of_its_files(tmp_path):
    """Review 16a R2: the old run's measure.json stayed beside the new run's files when the new one had none yet."""
    out, published = tmp_path / "grid", tmp_path / "published"
    old = _run(out, "lr0.5_stable8", numerics_=ELSEWHERE)
    (old / "measure.json").write_text('{"val": "old"}')
    archive_runs(out, published)
    supersede_other_trajectories(_chain(), out, HERE)
    _run(out, "lr0.5_stable8", numerics_=HERE)  # trained again, not measured yet
    archive_runs(out, published)
    assert not (published / "runs" / "lr0.5_stable8" / "measure.json").exists()
    assert recorded(published / "runs" / "lr0.5_stable8") == HERE
