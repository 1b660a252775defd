"""benchmarks.hf_qknorm_recipe: a --quick run end to end (tiny model, a few steps), and the
committed results file states its command and every stage."""

import json
import math
from pathlib import Path

import pytest

from tests.test_benchmarks import load as load_benchmark

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
COMMITTED = BENCHMARKS / "results" / "hf_qknorm_recipe_cpu.json"
STAGES = ("source", "unit_weights", "calibrated", "fine_tuned", "reloaded")


def load():
    return load_benchmark("hf_qknorm_recipe")


def check_result(result: dict, command: str = "python -m benchmarks.hf_qknorm_recipe ") -> None:
    """What every run's results file must hold, consistently (``command``: how it was run)."""
    assert result["status"] == "done"
    assert result["command"].startswith(command)
    assert {"cpu", "cores", "torch_threads", "torch"} <= set(result["machine"])
    loss = result["loss"]
    assert set(STAGES) <= set(loss) and all(math.isfinite(loss[s]) and loss[s] > 0 for s in STAGES)
    # The reloaded checkpoint computes the in-memory model's loss; plain MLA through qkmla, the source's.
    assert loss["reloaded"] == pytest.approx(loss["fine_tuned"], rel=1e-6)
    assert loss["source_reloaded_plain_mla"] == pytest.approx(loss["source"], rel=1e-5)
    warm = result["calibration"]["warm_start_losses"]  # warm_start_qk_norm's own measurement, same windows
    for stage in ("source", "unit_weights", "calibrated"):
        assert warm[stage] == pytest.approx(loss[stage], rel=1e-5)
    layers = result["calibration"]["layers"]
    assert sorted(layers, key=int) == [str(i) for i in range(result["config"]["num_hidden_layers"])]
    for layer in layers.values():  # calibration brings each block's logit RMS to the source's
        for block in ("content", "rope"):
            assert layer[block]["rms_calibrated"] == pytest.approx(layer[block]["rms_source"], rel=1e-4)
    ft = result["fine_tune"]
    assert ft["target_loss"] == pytest.approx(result["loss"]["source"] * (1 + result["settings"]["target"]), rel=1e-5)
    assert [e["step"] for e in ft["evals"]] == sorted(e["step"] for e in ft["evals"]) and ft["evals"]
    if ft["reached"]:  # stopped at the first evaluation within the target
        first = next(e for e in ft["evals"] if e["val_loss"] <= ft["target_loss"])
        assert ft["steps"] == ft["within_target_at_step"] == first["step"] == ft["evals"][-1]["step"]
        assert loss["fine_tuned"] == pytest.approx(first["val_loss"], rel=1e-5)  # Trainer's eval == ours
    else:
        assert ft["steps"] == ft["max_steps"] and all(e["val_loss"] > ft["target_loss"] for e in ft["evals"])
    assert ft["tokens"] == ft["steps"] * result["source_training"]["batch"] * result["source_training"]["block"]
    summary = result["summary"]
    assert summary["within_target"] == ft["reached"] and summary["reloaded_equals_in_memory"]
    for sample in result["samples"]:  # generate() decoded through the latent cache, as without a cache
        assert sample["latent_cache"] and sample["same_tokens_without_cache"] and sample["new_tokens"] > 0
        assert sample["text"].startswith(sample["prompt"])
    cli = result["cli_generate"]
    assert cli["returncode"] == 0 and cli["stdout"].startswith("ROMEO:"), cli
    control = result["control_plain_mla"]
    if isinstance(control, dict):
        assert control["steps"] == ft["steps"] and [e["step"] for e in control["evals"]] == \
            [e["step"] for e in ft["evals"]]
        assert loss["control_plain_mla_fine_tuned"] == pytest.approx(control["evals"][-1]["val_loss"], rel=1e-5)


def test_quick_run_writes_every_stage_consistently(tmp_path):
    pytest.importorskip("transformers")
    recipe = load()
    out, work = tmp_path / "recipe.json", tmp_path / "work"
    argv = ["--quick", "--threads", "1", "--work", str(work), "--out", str(out)]
    assert recipe.main(argv) == 0
    result = json.loads(out.read_text())
    check_result(result)
    assert result["machine"]["torch_threads"] == 1 and result["config"] == recipe.QUICK_SHAPE
    assert (work / "source" / "config.json").is_file() and (work / "qknorm" / "config.json").is_file()
    assert not (work / "trainer").exists()
    saved = json.loads((work / "qknorm" / "config.json").read_text())
    assert saved["qkmla"]["qk_norm"]["kind"] == "rms"
    with pytest.raises(SystemExit):  # an existing result is not replaced without --overwrite
        recipe.main(argv[:-2] + ["--out", str(tmp_path / "other.json")])  # (the work dir is taken too)
    with pytest.raises(SystemExit):
        recipe.main(["--quick", "--work", str(tmp_path / "w2"), "--out", str(out)])


@pytest.mark.parametrize("argv, option", [(["--batch", "0"], "--batch"), (["--threads", "-1"], "--threads"),
                                          (["--block", "100000"], "--block"), (["--target", "-0.1"], "--target")])
def test_refuses_bad_arguments_naming_them(argv, option, tmp_path, capsys):
    with pytest.raises(SystemExit):
        load().main(argv + ["--work", str(tmp_path)])
    assert option in capsys.readouterr().err


def test_committed_result_states_its_command_and_every_stage():
    result = json.loads(COMMITTED.read_text())
    assert "--quick" not in result["command"]
    check_result(result)
    assert not result["commit"].endswith("+dirty"), "the committed run names a clean commit"
    assert result["source_training"]["tokens"] > 0 and result["source_training"]["train_loss"]
    assert isinstance(result["control_plain_mla"], dict)
