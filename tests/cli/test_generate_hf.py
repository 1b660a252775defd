"""``qkmla generate --hf DIR`` through the command's entry point (issue 52, point 9): ``--device``
checked by name, the dtype the checkpoint's config records by default, ``--max-new-tokens``
(``--tokens`` is its other name)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from qkmla.cli import main  # noqa: E402
from qkmla.integrations.transformers import generate as hf_generate  # noqa: E402

from ..integrations.transformers.test_generate import byte_tokenizer  # noqa: E402
from ..integrations.transformers.test_model import hf_model  # noqa: E402

ACCELERATOR = torch.cuda.is_available() or (hasattr(torch, "accelerator") and torch.accelerator.is_available())


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint saved in bfloat16, with a tokenizer."""
    root = tmp_path_factory.mktemp("bf16")
    hf_model("v3", dtype=torch.bfloat16).save_pretrained(root)
    byte_tokenizer().save_pretrained(root)
    assert json.loads((root / "config.json").read_text())["dtype"] == "bfloat16"
    return root


@pytest.fixture
def loads(monkeypatch):
    """The models the command loads, as it loads them (the real loader runs)."""
    models = []
    real = hf_generate.load_hf_dir

    def recording(*args, **kwargs):
        model, tokenizer = real(*args, **kwargs)
        models.append(model)
        return model, tokenizer

    monkeypatch.setattr(hf_generate, "load_hf_dir", recording)
    return models


def _generated(capsys) -> str:
    return capsys.readouterr().out.split("-" * 40)[0].strip("\n")


def test_the_checkpoint_loads_in_its_recorded_dtype_on_the_named_device(bf16_dir, loads, capsys):
    assert main(["generate", "--hf", str(bf16_dir), "--prompt", "abc", "--max-new-tokens", "4", "--temperature", "0",
                 "--device", "cpu"]) == 0
    text = _generated(capsys)
    weight = next(loads[-1].parameters())
    assert weight.dtype == torch.bfloat16 and weight.device.type == "cpu"  # float32 before issue 52
    assert text.startswith("abc") and len(text) <= len("abc") + 4  # a byte a token, at most 4
    # --tokens is the same option; an explicit --dtype wins over the checkpoint's
    assert main(["generate", "--hf", str(bf16_dir), "--prompt", "abc", "--tokens", "4", "--temperature", "0"]) == 0
    assert _generated(capsys) == text
    assert main(["generate", "--hf", str(bf16_dir), "--prompt", "abc", "--max-new-tokens", "2", "--dtype",
                 "float32"]) == 0
    assert next(loads[-1].parameters()).dtype == torch.float32


def test_a_config_without_a_model_type_is_refused_as_not_a_transformers_checkpoint(tmp_path, refused):
    root = tmp_path / "a-qkmla-run"  # a qkmla run's config.json names no model_type
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"n_layer": 2, "attn": "mla-qknorm"}))
    refused(["generate", "--hf", str(root), "--dtype", "float32", "--max-new-tokens", "1"],
            r"--hf: .*names no model_type, so it is not a transformers checkpoint \(a qkmla training run is "
            r"generated from as the run argument, without --hf\)")


def test_a_config_without_a_dtype_loads_in_float32_and_one_that_is_not_loadable_is_refused(bf16_dir, tmp_path, loads,
                                                                                          refused):
    root = tmp_path / "ckpt"
    shutil.copytree(bf16_dir, root)
    config = json.loads((root / "config.json").read_text())
    without = {k: v for k, v in config.items() if k != "dtype"}
    (root / "config.json").write_text(json.dumps(without))
    assert main(["generate", "--hf", str(root), "--prompt", "abc", "--max-new-tokens", "1"]) == 0
    assert next(loads[-1].parameters()).dtype == torch.float32
    (root / "config.json").write_text(json.dumps({**without, "torch_dtype": "float16"}))
    refused(["generate", "--hf", str(root), "--max-new-tokens", "1"],
            r"--dtype: .*config.json records dtype 'float16', which --hf does not load in; give --dtype, one of "
            r"\('float32', 'bfloat16', 'float64'\)")
    (root / "config.json").write_text(json.dumps({**without, "torch_dtype": "bfloat16"}))  # transformers 4's name
    assert main(["generate", "--hf", str(root), "--prompt", "abc", "--max-new-tokens", "1"]) == 0
    assert next(loads[-1].parameters()).dtype == torch.bfloat16


@pytest.mark.cuda
def test_bad_devices_and_counts_are_refused_by_name_before_loading(bf16_dir, tmp_path, loads, refused):
    refused(["generate", "--hf", str(bf16_dir), "--device", "gpu"],
            r"--device: expected one of \('cpu'.*\) on this machine.*, got 'gpu'")
    if not ACCELERATOR:
        refused(["generate", "--hf", str(bf16_dir), "--device", "cuda"],
                r"--device: expected one of \('cpu',\) on this machine \(torch sees no accelerator here\), got 'cuda'")
    else:
        refused(["generate", "--hf", str(bf16_dir), "--device", "cuda:99"], r"--device: .*got 'cuda:99'")
    refused(["generate", "--hf", str(bf16_dir), "--max-new-tokens", "0"], "--max-new-tokens: expected a positive int")
    refused(["generate", str(tmp_path / "run"), "--device", "cpu"],
            "--device: sets where a --hf checkpoint runs; a qkmla run is sampled on the CPU")
    assert loads == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_model_and_its_prompts_run_on_cuda(bf16_dir, loads, capsys):
    assert main(["generate", "--hf", str(bf16_dir), "--prompt", "abc", "--max-new-tokens", "4", "--temperature", "0",
                 "--device", "cuda"]) == 0
    on_gpu = _generated(capsys)
    assert next(loads[-1].parameters()).device.type == "cuda"
    assert main(["generate", "--hf", str(bf16_dir), "--prompt", "abc", "--max-new-tokens", "4", "--temperature", "0",
                 "--dtype", "float32"]) == 0
    assert on_gpu.startswith("abc") and _generated(capsys).startswith("abc")
