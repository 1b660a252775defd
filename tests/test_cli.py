import json
import subprocess
import sys

import pytest

from qkmla import verify
from qkmla.cli import main


def test_verify_json_rows(capsys):
    assert main(["verify", "--json", "--variant", "rms-blockwise", "--variant", "lp-3"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["variant"], r["dtype"]) for r in rows] == [
        (v, d) for v in ("rms-blockwise", "lp-3") for d in ("float64", "float32", "bfloat16")]
    for r in rows:
        assert {"variant", "dtype", "max_abs_logit_diff", "max_abs_output_diff", "tolerance", "ok"} <= set(r)
        assert r["ok"] is True


def test_verify_table_covers_every_variant(capsys):
    assert main(["verify"]) == 0
    out = capsys.readouterr().out
    for name in ["rms-blockwise", "rms-unified", "l2", "lp-1", "lp-1.5", "lp-3", "lp-4", "none",
                 "rms-gqa-G2", "rms-no-q-lora", "rms-odd-sizes"]:
        assert f"\n{name} " in out
    assert "FAIL" not in out


def test_verify_exits_non_zero_on_failure(monkeypatch, capsys):
    monkeypatch.setattr(verify, "FLOAT64_RTOL", 0.0)  # no float64 row can meet a zero tolerance
    assert main(["verify", "--variant", "rms-blockwise"]) == 1
    assert "FAILED: rms-blockwise/float64" in capsys.readouterr().err


def test_verify_unknown_variant():
    with pytest.raises(SystemExit, match="--variant"):
        main(["verify", "--variant", "rms-fast"])


def test_cache_size_presets(capsys):
    main(["cache-size", "--preset", "llama-3-70b"])
    out = capsys.readouterr().out
    assert "10,485,760,000" in out and "10.5 GB" in out and "83.9 GB" in out
    main(["cache-size", "--preset", "deepseek-v2", "--json"])
    data = json.loads(capsys.readouterr().out)
    mla = next(r for r in data["rows"] if r["variant"] == "mla")
    assert mla["values_per_token_layer"] == 576 and data["shape"]["num_layers"] == 60
    main(["cache-size", "--preset", "deepseek-v3-tp8", "--tokens", "1"])
    assert "add 32 bytes to 1,152" in capsys.readouterr().out


def test_cache_size_from_flags(capsys):
    main(["cache-size", "--num-layers", "2", "--num-heads", "4", "--head-dim", "8", "--kv-lora-rank", "16",
          "--qk-rope-head-dim", "4", "--tokens", "10", "--json", "--dtype", "fp32"])
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows["mha"]["bytes_per_token_layer"] == 2 * 4 * 8 * 4
    assert rows["mla-qknorm"]["bytes_per_request"] == (20 * 4 + 4 * 4) * 2 * 10


def test_cache_size_needs_a_shape():
    with pytest.raises(SystemExit, match="--preset"):
        main(["cache-size"])
    with pytest.raises(SystemExit, match="tokens"):
        main(["cache-size", "--preset", "tiny", "--tokens", "0"])


def test_console_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "qkmla", "cache-size", "--preset", "deepseek-v3"],
                         capture_output=True, text=True, check=True).stdout
    assert "mla-qknorm" in out


def test_train_plot_generate(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--attn", "mla-lp", "--qk-norm-p", "3", "--steps", "4",
                 "--batch-size", "4", "--block-size", "16", "--eval-interval", "2", "--eval-iters", "1",
                 "--optimizer", "muon", "--no-progress", "--out", str(run)]) == 0
    status = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert status["status"] == "done" and status["step"] == 4
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "ROMEO:", "--prompt", "A", "--tokens", "5", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and out.count("-" * 40) == 2


def test_train_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--attn", "linear"])
    with pytest.raises(SystemExit, match="--steps"):
        main(["train", "--steps", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="qk-norm-p"):
        main(["train", "--qk-norm-p", "0.5", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--softmax-scale"):
        main(["train", "--softmax-scale", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="run_dir"):
        main(["generate", str(tmp_path / "nothing")])


def test_train_learnable_logit_scale_flag(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--preset", "debug", "--attn", "mla-qknorm", "--learnable-logit-scale", "--steps", "2",
                 "--batch-size", "2", "--block-size", "8", "--eval-interval", "2", "--eval-iters", "1",
                 "--no-progress", "--out", str(run)]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["logit_scale"] > 0 and rows[-1]["logit_bound"] > 0
