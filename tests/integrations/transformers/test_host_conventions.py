"""What transformers' own model tests ask of a patched model (issue 52, point 8), tested here
without transformers' test tree: attention weights when asked, every rope_type, meta-device
construction followed by weight loading. The conformance run (``conformance/``) runs the tests themselves."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.cache import StreamingLLM  # noqa: E402
from qkmla.integrations.transformers import apply_latent_attention  # noqa: E402

from .test_model import SHAPE, hf_model, left_padded, prompts  # noqa: E402


def eager_and_patched(variant: str):
    stock = hf_model(variant)
    stock.set_attn_implementation("eager")  # the stock attention that returns weights
    return stock, apply_latent_attention(copy.deepcopy(stock))


def real(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Weights of the real queries (padding query rows are undefined in transformers: NaN in eager)."""
    return (weights * mask[:, None, -weights.shape[2]:, None]).nan_to_num(0.0)


@pytest.mark.parametrize("variant, use_cache", [("v3", False), ("v3", True), ("v2", True)])
def test_output_attentions_returns_transformers_weights(variant, use_cache):
    stock, model = eager_and_patched(variant)
    ids, mask = left_padded(prompts([5, 8]))
    with torch.no_grad():
        want = stock(ids, attention_mask=mask, output_attentions=True).attentions
        got = model(ids, attention_mask=mask, output_attentions=True, use_cache=use_cache).attentions
    assert len(got) == len(want) == stock.config.num_hidden_layers
    for layer, (w, g) in enumerate(zip(want, got)):
        assert g.shape == w.shape == (2, stock.config.num_attention_heads, 8, 8)
        torch.testing.assert_close(g[1], w[1], rtol=0, atol=1e-6)  # the row without padding
        if layer == 0:  # eager's padding rows are NaN, which reaches the padded row's later layers
            torch.testing.assert_close(real(g, mask), real(w, mask), rtol=0, atol=1e-6)


def test_generate_returns_each_steps_weights_over_the_mask_columns():
    stock, model = eager_and_patched("v3")
    ids, mask = left_padded(prompts([6, 8]))
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, output_attentions=True,
                  return_dict_in_generate=True)
    want, got = stock.generate(ids[1:], **dict(kwargs, attention_mask=mask[1:])), model.generate(ids, **kwargs)
    assert torch.equal(got.sequences[1], want.sequences[0])
    for step, (w, g) in enumerate(zip(want.attentions, got.attentions)):
        for w_layer, g_layer in zip(w, g):
            assert g_layer.shape[0] == 2 and g_layer.shape[-1] == 8 + step  # every column of the mask
            torch.testing.assert_close(g_layer[1:], w_layer, rtol=0, atol=1e-6)
            assert float(g_layer[0, ..., :2].abs().max()) == 0.0  # row 0's two padding columns
            torch.testing.assert_close(g_layer.sum(-1)[0, :, -1], torch.ones_like(g_layer[0, :, -1, 0]))


def test_output_attentions_carry_gradients():
    stock, model = eager_and_patched("v3")
    ids = torch.stack(prompts([7]))
    out = model(ids, use_cache=False, output_attentions=True)
    assert len(out.attentions) == stock.config.num_hidden_layers and out.attentions[0].requires_grad
    out.attentions[0].retain_grad()  # transformers' test_retain_grad_hidden_states_attentions does this
    out.logits.sum().backward()
    assert out.attentions[0].grad is not None  # the output is computed from the weights
    torch.testing.assert_close(out.logits, model(ids, use_cache=False).logits, rtol=0, atol=1e-10)


def test_output_attentions_with_an_evicting_cache_is_refused():
    model = apply_latent_attention(hf_model("v3"), policy=StreamingLLM(sinks=2, budget=6))
    with pytest.raises(ValueError, match="output_attentions: this model's caches evict tokens"):
        model(torch.stack(prompts([5])), output_attentions=True)


@pytest.mark.parametrize("version, rope", [(3, {"rope_type": "linear", "factor": 2.0}),
                                           (2, {"rope_type": "dynamic", "factor": 2.0})])
def test_every_rope_type_through_transformers_rotary_embedding(version, rope):
    config_cls, model_cls = ((transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM) if version == 3
                             else (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM))
    shape = dict(SHAPE, max_position_embeddings=8)  # "dynamic" rescales past 8 positions
    if version == 2:
        shape.pop("first_k_dense_replace")
    torch.manual_seed(0)
    stock = model_cls(config_cls(**shape, q_lora_rank=24, rope_parameters=dict(rope, rope_theta=100.0))).double().eval()
    model = apply_latent_attention(copy.deepcopy(stock))
    ids = torch.stack(prompts([12, 12]))
    with torch.no_grad():
        want, got = stock(ids).logits, model(ids, use_cache=False).logits
        assert float((got - want).abs().max() / want.abs().max()) < 1e-6
        greedy = dict(max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(ids, **greedy), stock.generate(ids, **greedy))


def test_meta_device_construction_then_weight_loading(tmp_path):
    stock = hf_model("v3", dtype=torch.float32)
    stock.save_pretrained(tmp_path)

    class PatchedAtConstruction(transformers.DeepseekV3ForCausalLM):  # what the conformance run does
        def __init__(self, config):
            super().__init__(config)
            apply_latent_attention(self)

    model = PatchedAtConstruction.from_pretrained(tmp_path).eval()  # built on the meta device, then loaded
    assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
    ids = torch.stack(prompts([9]))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=False).logits, stock(ids).logits, rtol=1e-4, atol=1e-5)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False),
                           stock.generate(ids, max_new_tokens=4, do_sample=False))


@pytest.mark.parametrize("copy_by", ["deepcopy", "torch.save"])
def test_a_prompts_cache_reused_as_transformers_documents(tmp_path, copy_by):
    """transformers' recipe for a shared prefix: fill a cache with the prompt once, then give each
    continuation a copy (``copy.deepcopy``), or keep it on disk (``torch.save``). Either copy
    continues exactly as one generate over the whole input does."""
    from qkmla.integrations.transformers import LatentAttentionCache

    model = apply_latent_attention(hf_model("v3"), qk_norm="rms").eval()
    prefix = torch.stack(prompts([7, 7]))
    whole = torch.cat([prefix, torch.stack(prompts([3, 3]))], dim=1)
    with torch.no_grad():
        filled = model(prefix, past_key_values=LatentAttentionCache(model)).past_key_values
    if copy_by == "deepcopy":
        cache = copy.deepcopy(filled)
        assert torch.equal(cache.layers[0].keys, filled.layers[0].keys)  # the copy still finds its attention
        reference = filled.layers[0].attention
        assert copy.copy(reference)() is reference() is not None  # a shallow copy shares it too
    else:
        torch.save(filled, tmp_path / "prompt.pt")
        cache = torch.load(tmp_path / "prompt.pt", weights_only=False)
        assert cache.layers[0].keys is None  # saved without the model: read again after its next forward
    with torch.no_grad():
        reused = model.generate(whole, past_key_values=cache, max_new_tokens=4, do_sample=False)
        fresh = model.generate(whole, past_key_values=LatentAttentionCache(model), max_new_tokens=4, do_sample=False)
    assert torch.equal(reused, fresh)
    assert cache.layers[0].keys is not None
    assert filled.get_seq_length() == prefix.shape[1]  # the original is untouched, ready for the next continuation
