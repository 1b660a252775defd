"""``convert.stream``: a conversion that holds one decoder layer at a time computes what the whole
model, loaded and calibrated in memory, computes, and writes every source tensor unchanged."""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.convert import convert_checkpoint, warm_start_qk_norm  # noqa: E402
from qkmla.convert.qk_norm import calibration_batches  # noqa: E402
from qkmla.convert.stream import CheckpointStream  # noqa: E402
from qkmla.integrations.transformers import apply_latent_attention, from_pretrained  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402

from tests.convert.test_qk_norm import tensors  # noqa: E402
from tests.integrations.transformers.test_model import hf_model  # noqa: E402

TEXT = "".join(chr(32 + (i * 7919) % 60) for i in range(6000))  # ByT5 ids (byte + 3) below the vocab of 97


@pytest.fixture(scope="module", params=["v3", "v2-lite-yarn"])
def source(request, tmp_path_factory):
    """A random DeepSeek checkpoint (a dense first layer, MoE after it) in float32, in many shards,
    with a byte-level tokenizer."""
    model = hf_model(request.param, dtype=torch.float32)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, max_shard_size="40KB")
    transformers.ByT5Tokenizer().save_pretrained(path)
    assert len(list(path.glob("*.safetensors"))) > 5
    return path


def in_memory(src, norm: str):
    """The reference: the whole model loaded and calibrated in memory (``warm_start_qk_norm``)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(src)
    cal, held = calibration_batches(tokenizer, TEXT, 256, 256)
    model = apply_latent_attention(from_pretrained(src), qk_norm=norm)
    return model, warm_start_qk_norm(model, cal, held_out_ids=held)


def test_streamed_conversion_is_the_in_memory_calibration(source, tmp_path):
    out = tmp_path / "out"
    report = convert_checkpoint(source, out, qk_norm="rms", calibration_tokens=256, calibration_text=TEXT)
    model, want = in_memory(source, "rms")
    assert report["tokens"] == want["tokens"] and sorted(report["layers"]) == sorted(want["layers"]) == [0, 1, 2]
    for name in ("source", "unit_weights", "calibrated"):
        assert report["loss"][name] == pytest.approx(want["loss"][name], rel=1e-5)
    for i, blocks in want["layers"].items():
        for block, values in blocks.items():
            for key, value in values.items():
                assert report["layers"][i][block][key] == pytest.approx(value, rel=1e-5), (i, block, key)
    old, new = tensors(source), tensors(out)
    assert all(torch.equal(old[k], new[k]) for k in old)  # every source tensor, bit for bit
    state = model.state_dict()
    added = sorted(set(new) - set(old))
    assert added and all(torch.allclose(new[k].float(), state[k].float(), rtol=1e-5) for k in added)
    # what transformers and qkmla read back: the model the in-memory conversion holds
    loaded = from_pretrained(out)
    ids = torch.randint(0, 97, (2, 12))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert json.loads((out / "config.json").read_text())["model_type"].startswith("qkmla_deepseek_v")
    assert (out / "tokenizer_config.json").read_bytes() == (source / "tokenizer_config.json").read_bytes()


def test_one_decoder_layer_is_held_at_a_time(source, tmp_path, monkeypatch):
    alive, most = [], [0]
    load = CheckpointStream.layer

    def counted(self, index):
        gc.collect()
        alive[:] = [ref for ref in alive if ref() is not None]
        model = load(self, index)
        alive.append(weakref.ref(model))
        most[0] = max(most[0], len(alive))
        return model

    monkeypatch.setattr(CheckpointStream, "layer", counted)
    convert_checkpoint(source, tmp_path / "out", qk_norm="l2", calibration_tokens=64, calibration_text=TEXT)
    assert most[0] == 1


def test_a_new_dtype_casts_shard_by_shard_as_transformers_loads_it(source, tmp_path):
    out = tmp_path / "bf16"
    convert_checkpoint(source, out, qk_norm="rms", calibration_tokens=0, dtype=torch.bfloat16)
    stored = {k: v.dtype for k, v in tensors(out).items()}
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    both = [k for k in stored if k in params]
    assert both and all(stored[k] == params[k].dtype for k in both)  # gate weights stay float32 where transformers keeps them
    layer = latent_layers(from_pretrained(out))[0]
    assert layer.kv_b_proj.weight.dtype == torch.bfloat16 and torch.all(layer.q_norm.content.weight == 1)


def test_a_single_file_source_becomes_an_indexed_checkpoint(tmp_path):
    model = hf_model("v3", dtype=torch.float32)
    src = tmp_path / "single"
    model.save_pretrained(src)
    assert (src / "model.safetensors").is_file()
    out = tmp_path / "out"
    convert_checkpoint(src, out, qk_norm="rms", calibration_tokens=0)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                 "model-00002-of-00002.safetensors"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors(out))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors(out).values())
    ids = torch.randint(0, 97, (1, 9))
    want = apply_latent_attention(model.eval(), qk_norm="rms")(ids).logits  # unit weights: as written
    torch.testing.assert_close(from_pretrained(out)(ids).logits, want)
