"""benchmarks.gqa_convert_recipe: a --quick run end to end (tiny Qwen3 sources, a few steps) whose
results file is complete and consistent, and the committed results file states a full run's command
and every variant."""

import json
import math
from pathlib import Path

import pytest

from tests.test_benchmarks import load as load_benchmark

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
COMMITTED = BENCHMARKS / "results" / "gqa_convert_recipe_cpu.json"


def load():
    return load_benchmark("gqa_convert_recipe")


def check_measures(m: dict) -> None:
    assert math.isfinite(m["loss"]) and m["loss"] > 0
    assert m["ppl"] == pytest.approx(math.exp(m["loss"]), rel=1e-4)
    assert 0 <= m["agreement"] <= 1 and 0 <= m["accuracy"] <= 1


def check_result(result: dict, recipe, command: str = "python -m benchmarks.gqa_convert_recipe ") -> None:
    """What every run's results file must hold, consistently (``command``: how it was run)."""
    assert result["status"] == "done"
    assert result["command"].startswith(command)
    assert {"cpu", "cores", "torch_threads", "torch"} <= set(result["machine"]) and "commit" in result
    settings, heal = result["settings"], result["healing"]
    assert heal["lrs"] == settings["heal_lrs"] and heal["steps"] == settings["heal_steps"]
    assert set(result["measures"]["cache_values_per_token_per_layer"]) == set(recipe.VARIANTS)
    assert list(result["sources"]) == [f"G{G}" for G in settings["kv_heads"]]
    for tag, source in result["sources"].items():
        config = source["config"]
        G, D, L = config["num_key_value_heads"], config["head_dim"], config["num_hidden_layers"]
        rows = [v for v in result["variants"] if v["source"] == tag]
        # (a) once, (b)-(d) and (g) once per compression and RoPE share, (e) once per compression, (f) as (b)
        # for G > 1
        converted = recipe.VARIANTS[1:4] + ("keep_norm_calibrated",) + (("keep_norm_principal",) if G > 1 else ())
        assert sorted((v["variant"], v["compression"], v["rope_share"] or 0) for v in rows) == sorted(
            [("source", 1, 0)] + [(k, f, x) for k in converted for f in settings["compressions"]
                                  for x in settings["rope_shares"]]
            + [("svd_cache", f, 0) for f in settings["compressions"]])
        if G > 1:  # the principal mix is the best single RoPE key per pair: at least the mean's energy
            mean, principal = source["full_rank_conversion"], source["full_rank_conversion_principal"]
            assert all(p >= m - 1e-9 for p, m in zip(principal["rope_key_energy_per_layer"],
                                                      mean["rope_key_energy_per_layer"]))
            check_measures(principal["not_healed"])
        full = source["full_rank_conversion"]
        assert full["latent_cache_bytes_per_token"] == full["cache_bytes_per_token"]
        check_measures(full["not_healed"])
        if G == 1:  # full rank, every RoPE pair: the source's function (float32 roundoff)
            src = next(v for v in rows if v["variant"] == "source")
            assert full["not_healed"]["loss"] == pytest.approx(src["before"]["loss"], rel=1e-4)
        source_bytes = 2 * G * D * recipe.BYTES * L
        for v in rows:
            s = v["settings"]
            values = recipe.cache_values(v["variant"], G, D, s.get("kv_lora_rank", 0), s.get("rope_dim", 0),
                                         s.get("r_k", 0), s.get("r_v", 0))
            assert v["cache_values_per_token_per_layer"] == values
            assert v["cache_bytes_per_token"] == values * recipe.BYTES * L
            if v["variant"] in ("keep_norm", "keep_norm_principal", "keep_norm_calibrated", "svd_cache"):  # the budget
                assert v["cache_bytes_per_token"] * v["compression"] == source_bytes
            if v["variant"] not in ("source", "full_keys", "svd_cache"):  # the latent cache generate fills
                assert v["latent_cache_bytes_per_token"] == v["cache_bytes_per_token"]
            if v["variant"] == "full_keys":  # its keys alone are half the source's cache
                assert v["cache_bytes_per_token"] > source_bytes // 2
            check_measures(v["before"])
            assert sorted(v["healed"], key=float) == sorted(f"{lr:g}" for lr in heal["lrs"])
            for h in v["healed"].values():
                check_measures(h)
                assert h["train_loss"][-1]["step"] == heal["steps"]
        src = next(v for v in rows if v["variant"] == "source")
        assert src["before"]["agreement"] == 1.0 and src["cache_bytes_per_token"] == source_bytes
    assert len(result["table"]) == len(result["variants"])
    for row, v in zip(result["table"], result["variants"]):
        assert row["loss_before"] == v["before"]["loss"] and row["cache_bytes_per_token"] == v["cache_bytes_per_token"]


def test_quick_run_writes_every_variant_consistently(tmp_path):
    pytest.importorskip("transformers")
    recipe = load()
    out, work = tmp_path / "recipe.json", tmp_path / "work"
    argv = ["--quick", "--threads", "1", "--work", str(work), "--out", str(out)]
    assert recipe.main(argv) == 0
    result = json.loads(out.read_text())
    check_result(result, recipe)
    assert result["machine"]["torch_threads"] == 1 and result["settings"]["quick"]
    assert all((work / f"source-G{G}" / "config.json").is_file() for G in result["settings"]["kv_heads"])
    with pytest.raises(SystemExit):  # an existing result is not replaced without --overwrite
        recipe.main(argv[:-2] + ["--out", str(tmp_path / "other.json")])  # (the work dir is taken too)
    with pytest.raises(SystemExit):
        recipe.main(["--quick", "--work", str(tmp_path / "w2"), "--out", str(out)])


@pytest.mark.parametrize("argv, option", [(["--batch", "0"], "--batch"), (["--threads", "-1"], "--threads"),
                                          (["--block", "100000"], "--block"), (["--kv-heads", "3"], "--kv-heads"),
                                          (["--compressions", "64"], "--compressions"),
                                          (["--heal-lrs", "0"], "--heal-lrs"),
                                          (["--rope-shares", "1.5"], "--rope-shares")])
def test_refuses_bad_arguments_naming_them(argv, option, tmp_path, capsys):
    with pytest.raises(SystemExit):
        load().main(argv + ["--work", str(tmp_path)])
    assert option in capsys.readouterr().err


def test_committed_result_states_its_command_and_every_variant():
    if not COMMITTED.exists():
        pytest.skip(f"{COMMITTED.name} is not committed yet")
    result = json.loads(COMMITTED.read_text())
    assert "--quick" not in result["command"] and not result["settings"]["quick"]
    check_result(result, load(), command="python benchmarks/gqa_convert_recipe.py")  # as it ran, before the package
    assert {v["variant"] for v in result["variants"]} == set(load().VARIANTS)
    assert any(source["config"]["num_key_value_heads"] > 1 for source in result["sources"].values())
