"""A whole HF DeepSeek-V3 checkpoint directory (sharded safetensors) loads layer by layer into MLA."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from qkmla.integrations.hub import checkpoint  # noqa: E402
from qkmla.integrations.hub import mla_layers_from_hf_dir  # noqa: E402

T = 48  # runs past the YaRN original context L0 = 32 of the `saved` checkpoint (conftest.py)


def test_every_layer_matches_transformers(saved, attention_io):
    path, model = saved
    shards = list(path.glob("model-*.safetensors"))
    assert len(shards) >= 4
    layers = mla_layers_from_hf_dir(path, dtype=torch.float64)
    assert list(layers) == [0, 1, 2] and layers[0].config.rope_scaling.factor == 4.0
    io = attention_io(model, torch.randint(0, 100, (2, T)))
    for i, mla in layers.items():
        x, ref = io[i]
        with torch.no_grad():
            err = float((mla.eval()(x) - ref).abs().max() / ref.abs().max())
        # transformers' float32 RoPE tables, RMSNorms and softmax set this bound (tests/integrations/hub/test_config.py)
        assert err <= 5e-6, (i, err)
    assert mla_layers_from_hf_dir(path, 2)[2].kv_b_proj.weight.dtype == torch.float32  # the stored dtype by default


class Spy:
    """safe_open that records which files are opened and which tensors are read."""
    opened, read = [], []
    real = staticmethod(checkpoint.safe_open)

    def __init__(self, file, framework):
        Spy.opened.append(file.rsplit("/", 1)[-1])
        self.f = Spy.real(file, framework=framework)

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_slice(self, key):
        return self.f.get_slice(key)

    def get_tensor(self, key):
        Spy.read.append(key)
        return self.f.get_tensor(key)


@pytest.fixture
def spy(monkeypatch):
    Spy.opened, Spy.read = [], []
    monkeypatch.setattr(checkpoint, "safe_open", Spy)
    return Spy


def test_reads_only_the_chosen_layers_attention_tensors(saved, spy):
    path, _ = saved
    mla_layers_from_hf_dir(path, 1)
    weight_map = json.loads((path / checkpoint.INDEX).read_text())["weight_map"]
    wanted = {k for k in weight_map if k.startswith("model.layers.1.self_attn.")}
    assert set(spy.read) == wanted and len(spy.read) == len(wanted) == 7
    assert set(spy.opened) == {weight_map[k] for k in wanted} and len(spy.opened) < len(set(weight_map.values()))


def test_a_layer_index_of_another_type_is_named_before_reading(saved, spy):
    """Probe 11b (m04): mla_layers_from_hf_dir(path, layers=1.0) failed in list() with "'float' object is not
    iterable", naming nothing; and a NumPy index (np.int64(1)) was refused as not an index. A float or a
    string is refused naming layers before any tensor is read; NumPy indices select their layers."""
    import numpy as np

    path, _ = saved
    for value in (1.0, "ab", True, [0, 1.5]):
        with pytest.raises(ValueError, match=r"^layers: expected layer indices in \[0, 3\)"):
            mla_layers_from_hf_dir(path, value)
    assert spy.read == []
    assert list(mla_layers_from_hf_dir(path, np.int64(1))) == [1]
    assert list(mla_layers_from_hf_dir(path, [np.int64(2), 0])) == [0, 2]


def _copy(saved, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(saved[0], dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_bad_directories_fail_before_reading(saved, tmp_path, spy):
    path = _copy(saved, tmp_path)
    with pytest.raises(ValueError, match=r"layers: expected layer indices in \[0, 3\)"):
        mla_layers_from_hf_dir(path, [0, 3])
    with pytest.raises(ValueError, match="hf_dir: .* is not a directory"):
        mla_layers_from_hf_dir(path / "nope")

    weight_map = json.loads((path / checkpoint.INDEX).read_text())["weight_map"]
    shard = weight_map["model.layers.2.self_attn.kv_b_proj.weight"]
    (path / shard).rename(path / "moved.safetensors")
    with pytest.raises(ValueError, match=f"model.safetensors.index.json names shard files .*{shard}"):
        mla_layers_from_hf_dir(path)
    (path / "moved.safetensors").rename(path / shard)

    index = json.loads((path / checkpoint.INDEX).read_text())
    del index["weight_map"]["model.layers.1.self_attn.o_proj.weight"]
    (path / checkpoint.INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json: the attention tensors \['model.layers.1.self_attn.o_proj"):
        mla_layers_from_hf_dir(path)
    shutil.copy(saved[0] / checkpoint.INDEX, path / checkpoint.INDEX)

    _edit_config(path, kv_lora_rank=24)
    with pytest.raises(ValueError, match=r"\.safetensors: model.layers.0.self_attn.kv_a_proj_with_mqa.weight has shape "
                                         r"\(48, 64\), the config in .*config.json needs \(40, 64\)"):
        mla_layers_from_hf_dir(path)
    _edit_config(path, kv_lora_rank=32, rope_parameters={"rope_type": "longrope", "rope_theta": 100.0})
    with pytest.raises(ValueError, match=r"config.json: hf_config: rope_type 'longrope' is not supported; "
                                         r"allowed: \('default', 'yarn'\)"):
        mla_layers_from_hf_dir(path)
    shutil.copy(saved[0] / "config.json", path / "config.json")
    _edit_config(path, model_type="llama")
    with pytest.raises(ValueError, match=r"config.json: hf_config: model_type must be one of"):
        mla_layers_from_hf_dir(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: not valid JSON"):
        mla_layers_from_hf_dir(path)
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json does not exist"):
        mla_layers_from_hf_dir(path)
    shutil.copy(saved[0] / "config.json", path / "config.json")
    (path / checkpoint.INDEX).unlink()
    with pytest.raises(ValueError, match="has neither model.safetensors.index.json nor model.safetensors"):
        mla_layers_from_hf_dir(path)
    assert spy.read == []  # every failure came before a tensor was read


def test_single_file_checkpoint_and_fp8_blocks(saved, tmp_path):
    """One model.safetensors; FP8 weights with 128 x 128 block scales are dequantized as DeepSeek-V3 ships them."""
    path, model = saved
    ref = mla_layers_from_hf_dir(path, 0, dtype=torch.float64)[0]
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(path / "config.json", flat / "config.json")
    tensors = {k: v.float().contiguous() for k, v in model.state_dict().items() if ".layers.0.self_attn." in k}
    # kv_b_proj as FP8 in 2 x 1 blocks of 16 x 128 (the block size comes from quantization_config)
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    w = tensors[key]
    scale = torch.tensor([[1.0], [3.0]]) * w.abs().amax() / 448  # e4m3 holds |x| <= 448
    blocks = scale.repeat_interleave(w.shape[0] // 2, 0)
    tensors[key] = (w / blocks).to(torch.float8_e4m3fn)
    tensors[key + "_scale_inv"] = scale
    save_file(tensors, str(flat / "model.safetensors"))
    _edit_config(flat, quantization_config={"quant_method": "fp8", "weight_block_size": [w.shape[0] // 2, 128]})
    mla = mla_layers_from_hf_dir(flat, 0)[0]
    assert mla.kv_b_proj.weight.dtype == torch.bfloat16  # as transformers dequantizes
    want = (tensors[key].float() * blocks).to(torch.bfloat16)
    assert torch.equal(mla.kv_b_proj.weight, want)
    # e4m3 keeps 3 mantissa bits: 2^-4 relative, and absolute below its smallest normal
    torch.testing.assert_close(mla.kv_b_proj.weight.double(), ref.kv_b_proj.weight, rtol=2 ** -4,
                               atol=1e-3 * float(w.abs().amax()))
    torch.testing.assert_close(mla.q_b_proj.weight.float(), ref.q_b_proj.weight.float(), rtol=4e-3, atol=0)
    del tensors[key + "_scale_inv"]
    save_file(tensors, str(flat / "model.safetensors"))
    with pytest.raises(ValueError, match="FP8 tensor .*kv_b_proj.weight needs .*kv_b_proj.weight_scale_inv"):
        mla_layers_from_hf_dir(flat, 0)


def test_integer_weights_and_a_null_index_entry_are_refused(saved, tmp_path, spy):
    """Issue 27, classes 2 and 3: an index that maps a tensor to null, and integer attention
    weights (cast silently or a traceback before), each give one error naming the file."""
    from safetensors import safe_open

    path = _copy(saved, tmp_path)
    index = json.loads((path / checkpoint.INDEX).read_text())
    good = dict(index["weight_map"])
    index["weight_map"]["model.layers.1.self_attn.o_proj.weight"] = None
    (path / checkpoint.INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json: 'weight_map' must map tensor names to shard file names; "
                                         r"'model.layers.1.self_attn.o_proj.weight' maps to None"):
        mla_layers_from_hf_dir(path)
    index["weight_map"] = good
    (path / checkpoint.INDEX).write_text(json.dumps(index))
    key = "model.layers.0.self_attn.kv_b_proj.weight"
    shard = path / good[key]
    with safe_open(str(shard), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[key] = tensors[key].round().to(torch.int32)
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=rf"{good[key]}: {key} is stored as I32; attention weights are floating point"):
        mla_layers_from_hf_dir(path)
    assert spy.read == []


def test_a_record_and_norm_tensors_that_disagree_are_refused_before_reading(saved, tmp_path, spy):
    """Issue 52, point 2: the loader reads config.json's "qkmla" record (integrations.hub.record):
    a recorded norm whose weights are missing, or norm weights whose norm is not recorded, is
    refused naming the files, never loaded as plain MLA."""
    path = _copy(saved, tmp_path)
    _edit_config(path, qkmla={"qk_norm": {"kind": "rms"}})
    with pytest.raises(ValueError, match=r"config.json records the norm rms blockwise but .*index.json lacks "
                                         r"\['model.layers.0.self_attn.k_norm.content.weight'"):
        mla_layers_from_hf_dir(path, 1)
    shutil.copy(saved[0] / "config.json", path / "config.json")
    index = json.loads((path / checkpoint.INDEX).read_text())
    index["weight_map"]["model.layers.1.self_attn.q_norm.content.weight"] = "extra.safetensors"
    save_file({"model.layers.1.self_attn.q_norm.content.weight": torch.ones(16)}, str(path / "extra.safetensors"))
    (path / checkpoint.INDEX).write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"index.json holds QK-norm weights .* but .*config.json records no norm"):
        mla_layers_from_hf_dir(path, 1)
    assert spy.read == []
    _edit_config(path, qkmla={"qk_norm": {"kind": "l2"}})
    with pytest.raises(ValueError, match=r"qk_norm: .*config.json records the QK norm l2 blockwise in its 'qkmla' "
                                         r"entry .* but rms blockwise was asked for"):
        mla_layers_from_hf_dir(path, 1, qk_norm="rms")


@pytest.mark.cuda
def test_paths_devices_and_dtypes_are_refused_by_name_before_reading(saved, tmp_path, spy):
    """Probe 9b (E05, E06, E10, E12, E14): ``checkpoint_dir("")`` returned the working directory (so
    ``from_pretrained("")`` loaded whatever was there); an over-long path raised a bare OSError from
    is_dir(); ``device="cuda"`` without CUDA ended in torch's AssertionError and ``dtype=torch.int8`` in
    nn.Module.to's TypeError after the checks; ``mla_from_hf(object())`` in an AttributeError. Each is
    one ValueError naming the argument, before any tensor is read."""
    from qkmla.integrations.hub import checkpoint_dir, mla_from_hf

    path, _ = saved
    with pytest.raises(ValueError, match="^hf_dir: expected the path of the checkpoint directory, got an empty"):
        checkpoint_dir("")
    for bad in ("", tmp_path / ("x" * 300)):
        with pytest.raises(ValueError, match="^hf_dir: "):
            mla_layers_from_hf_dir(bad)
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"^device: expected one of .*got '{missing}'"):
        mla_layers_from_hf_dir(path, 0, device=missing)
    with pytest.raises(ValueError, match="^dtype: expected None .* or a floating torch.dtype, got torch.int8"):
        mla_layers_from_hf_dir(path, 0, dtype=torch.int8)
    assert spy.read == []  # no tensor read
    with pytest.raises(ValueError, match="^hf_attention: expected a transformers DeepSeek-V2/V3 attention module"):
        mla_from_hf(object())


def test_an_override_that_contradicts_the_weights_is_named(saved):
    """Probe 9b (E08): mla_layers_from_hf_dir(path, 0, kv_lora_rank=64) on a checkpoint of rank 32 was
    blamed on 'the config in .../config.json', which holds 32: the override, the caller's own, is named."""
    path, _ = saved
    with pytest.raises(ValueError, match=r"^kv_lora_rank: the override \{'kv_lora_rank': 64\} does not fit the "
                                         r"weights: .* has shape"):
        mla_layers_from_hf_dir(path, 0, kv_lora_rank=64)


def test_a_path_that_is_not_utf8_and_a_revision_that_is_not_a_name_are_refused(saved, tmp_path, spy):
    """Probe 10b (h63, b03): ``from_pretrained`` (through ``checkpoint_dir``) and ``mla_layers_from_hf_dir`` of a
    checkpoint directory whose name is not UTF-8 read its config, then failed in safetensors as "not a readable
    safetensors file" of a file that was fine; ``checkpoint_dir(repo, revision=123)`` failed in huggingface_hub's
    regex, "expected string or bytes-like object, got 'int'". Each is refused naming the argument, before any
    tensor is read, as ``qkmla convert`` refuses such a path."""
    import os

    from qkmla.integrations.hub import checkpoint_dir
    from qkmla.integrations.transformers import from_pretrained

    path, _ = saved
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/ckpt\xff"))
    shutil.copytree(path, odd)
    for load in (checkpoint_dir, lambda p: mla_layers_from_hf_dir(p, 0), from_pretrained):
        with pytest.raises(ValueError, match="^hf_dir: .* is not a UTF-8 path, which safetensors and tokenizers "
                                             "cannot open; rename it"):
            load(odd)
    assert spy.read == []
    for revision in (123, "", b"main"):
        with pytest.raises(ValueError, match=f"^revision: expected None .* got {re.escape(repr(revision))}$"):
            checkpoint_dir("someone/some-model", revision=revision)
    with pytest.raises(ValueError, match="^subfolder: expected a path inside the checkpoint"):
        checkpoint_dir(path, subfolder=None)
    assert checkpoint_dir(path) == path  # a UTF-8 directory is itself, as before
