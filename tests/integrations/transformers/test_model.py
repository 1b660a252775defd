"""Whole transformers DeepSeek-V2/V3 models through ``apply_latent_attention``: generation, caches, padding.

Every model is built in memory from a config (no download): 3 layers, the first dense and the
others MoE (``first_k_dense_replace=1``), widths small enough for the suite's time.

Where the bound comes from: even in float64 transformers computes its RoPE tables in float32
(``DeepseekV2`` rotates in float32 too), qkmla in float64; the tables' error (about
t * 2^-24 per unit of angle, t the position) bounds the difference of the two models'
logits. ``tests/integrations/hub/test_config.py`` measures it on one layer (up to 1.7e-6 relative); three
layers and a LM head stay within 1e-5 of the largest logit, asserted at the prefill and every
decode step. In float32 both round everything else too: 1e-4.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.cache import SnapKV, StreamingLLM  # noqa: E402
from qkmla.integrations.transformers import LatentAttentionCache, apply_latent_attention  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402
from qkmla.integrations.hub.config import mla_config_from_hf  # noqa: E402

from .helpers import CACHE, max_rel, stepwise_logits  # noqa: E402,F401  (other test modules import them from here)

VOCAB = 97
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
             first_k_dense_replace=1, max_position_embeddings=256, pad_token_id=0, bos_token_id=None,
             eos_token_id=None, experts_implementation="eager")
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1, mscale=0.707,
            mscale_all_dim=1.0)
VARIANTS = {  # name: (version, q_lora_rank, rope, extra config)
    "v3": (3, 24, None, {}),
    "v3-no-q-lora": (3, None, None, {}),
    "v3-yarn": (3, 24, YARN, {}),
    "v3-half-rope": (3, 24, None, {"rope_interleave": False}),
    "v2": (2, 24, None, {}),
    "v2-lite-yarn": (2, None, YARN, {}),
}
OLD_V2_YARN = tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 16)


def hf_model(variant: str = "v3", dtype=torch.float64, seed: int = 0):
    """A random transformers model (eval mode) with weights and norms away from their init."""
    version, q_lora_rank, rope, extra = VARIANTS[variant]
    rope = dict(rope or {"rope_type": "default"}, rope_theta=100.0)  # small theta: YaRN's ramp lands in 4 pairs
    cls, model_cls = ((transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM) if version == 3
                      else (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM))
    cfg = cls(**SHAPE, **extra, q_lora_rank=q_lora_rank, rope_parameters=rope)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype).eval()
    if version == 2 and rope["rope_type"] == "yarn" and OLD_V2_YARN:
        # transformers before 5.16 leaves DeepSeek's YaRN softmax correction (mscale_all_dim) out of
        # DeepseekV2Attention; DeepSeek's own code, V3 and qkmla apply it. The reference gets it back.
        for layer in model.model.layers:
            layer.self_attn.scaling = mla_config_from_hf(cfg).scale
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name or "norm.weight" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "self_attn" in name and p.dim() == 2:
                p.mul_(3.0)  # logits of a few units, so attention is not flat
    return model


def patched(model, **kwargs):
    return apply_latent_attention(copy.deepcopy(model), **kwargs)


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    return ids, mask


def prompts(lengths, seed=1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


# -- the module swap ---------------------------------------------------------------------------

def test_state_dict_keeps_transformers_keys_and_tensors():
    ref = hf_model()
    model = patched(ref)
    assert list(model.state_dict()) == list(ref.state_dict())
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k
    attn = latent_layers(model)[1]
    # the HF layer's own modules are adopted, not copied
    assert attn.kv_b_proj is model.model.layers[1].self_attn.kv_b_proj
    assert type(attn.kv_a_layernorm).__name__ == "DeepseekV3RMSNorm"


def test_inner_model_and_repeated_apply():
    model = hf_model().model
    apply_latent_attention(model)
    first = latent_layers(model)[0]
    apply_latent_attention(model, kv_format="int8", decode_backend="naive")  # settings only
    assert latent_layers(model)[0] is first and first.config.decode_backend == "naive"
    assert model._qkmla_settings.kv_format == "int8"


@pytest.mark.parametrize("bad, match", [
    (dict(kv_format="fp4"), "kv_format"),
    (dict(policy="snapkv"), "policy"),
    (dict(decode_backend="cuda"), "decode_backend"),
])
def test_bad_arguments_are_refused_before_any_change(bad, match):
    model = hf_model()
    with pytest.raises(ValueError, match=match):
        apply_latent_attention(model, **bad)
    assert type(model.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"


def test_other_architectures_are_refused():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                                   num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="model: expected one of .*DeepseekV3ForCausalLM.*got LlamaForCausalLM"):
        apply_latent_attention(llama)
    with pytest.raises(ValueError, match="got Linear"):
        apply_latent_attention(torch.nn.Linear(2, 2))


# -- parity with the unpatched model -------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_and_every_decode_step_match_transformers_float64(variant):
    ref = hf_model(variant)
    model = patched(ref)
    ids = prompts([11, 11])
    ids = torch.stack(ids)
    want, fed = stepwise_logits(ref, ids, steps=6)
    got, fed_ours = stepwise_logits(model, ids, steps=6, cache=LatentAttentionCache(model))
    assert torch.equal(fed, fed_ours)  # greedy tokens identical
    for step, (a, b) in enumerate(zip(got, want)):
        assert max_rel(a, b) <= 1e-5, (variant, step, max_rel(a, b))


def test_no_cache_forward_and_loss_match_transformers():
    ref = hf_model("v3")
    model = patched(ref)
    ids = torch.stack(prompts([16, 16, 16]))
    with torch.no_grad():
        a, b = ref(ids, use_cache=False).logits, model(ids, use_cache=False).logits
    assert max_rel(b, a) <= 1e-5


def test_training_step_matches_transformers_and_caches_nothing():
    ref = hf_model("v3").train()
    model = patched(ref).train()
    ids = torch.stack(prompts([16, 16]))
    out_ref, out = ref(ids, labels=ids), model(ids, labels=ids)
    assert getattr(out, CACHE, None) is None and getattr(out, "past_key_values", None) is None
    assert abs(out.loss.item() - out_ref.loss.item()) <= 1e-6 * out_ref.loss.item()
    out_ref.loss.backward()
    out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert max_rel(p.grad, q.grad) <= 1e-5, name


def test_a_training_forward_asking_for_a_cache_gets_one_as_transformers_does():
    """Probe 14b H28/H48: in training, ``model(ids, use_cache=True)`` returned no cache (transformers' own model
    returns a DynamicCache), so a decode step given ``out.past_key_values`` (None) started a new sequence: its logits
    were a one-token prompt's, 0.77 off the stock model's, without a word. Asked for, a cache is made now and the
    step trains through it; left to the config's default (a loss), a training forward still caches nothing."""
    ref = hf_model("v3").train()
    model = patched(ref).train()
    ids = torch.stack(prompts([7, 7]))
    out = model(ids[:, :6], use_cache=True)
    cache = getattr(out, CACHE, None) or out.past_key_values
    assert isinstance(cache, LatentAttentionCache) and int(cache.get_seq_length()) == 6
    step = model(ids[:, 6:], use_cache=True, **{CACHE: cache}).logits[:, -1]
    want = ref(ids).logits[:, -1]
    assert max_rel(step.detach(), want.detach()) <= 1e-6
    want.square().sum().backward()
    step.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert max_rel(p.grad, q.grad) <= 1e-6, name
    assert getattr(model(ids, labels=ids), CACHE, None) is None  # a loss caches nothing, as before


def test_greedy_tokens_match_transformers_float32():
    ref = hf_model("v3", dtype=torch.float32)
    model = patched(ref)
    ids, mask = left_padded(prompts([6, 13]))
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want, got = ref.generate(ids, attention_mask=mask, **kw), model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert max_rel(a, b) <= 1e-4


# -- generation ----------------------------------------------------------------------------------

def test_left_padded_batch_gives_each_prompt_its_own_tokens():
    model = patched(hf_model("v3"))
    ps = prompts([4, 9, 12, 1])
    ids, mask = left_padded(ps)
    kw = dict(max_new_tokens=7, do_sample=False, return_dict_in_generate=True, output_logits=True)
    batched = model.generate(ids, attention_mask=mask, **kw)
    for b, p in enumerate(ps):
        alone = model.generate(p[None], **kw)
        assert torch.equal(batched.sequences[b, ids.shape[1]:], alone.sequences[0, len(p):]), b
        for a, c in zip(batched.logits, alone.logits):
            assert max_rel(a[b], c[0]) <= 1e-6  # generate hands its logits back in float32


def test_padding_contents_do_not_reach_real_tokens():
    model = patched(hf_model("v3"))
    ids, mask = left_padded(prompts([3, 10]))
    other = ids.clone()
    other[mask == 0] = 55  # another pad token id
    kw = dict(max_new_tokens=5, do_sample=False)
    assert torch.equal(model.generate(ids, attention_mask=mask, **kw)[:, ids.shape[1]:],
                       model.generate(other, attention_mask=mask, **kw)[:, ids.shape[1]:])


def test_a_row_of_padding_only_generates_as_transformers():
    """generate numbers a row's padding 0 and counts on from its last position, so a row that is all
    padding gets its first token at position 1, where qkmla's cache numbers it 0: the same relative
    positions, so the same attention. The pad token's embedding is made nonzero (this random model's
    is a zero padding_idx row), so the row's tokens say something."""
    ref = hf_model("v3")
    with torch.no_grad():
        ref.model.embed_tokens.weight[0].normal_()
    model = patched(ref)
    ids, mask = left_padded(prompts([5, 1, 8]))
    ids[1], mask[1] = 0, 0  # the middle row: all pad tokens, attention_mask all zeros
    kw = dict(max_new_tokens=6, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want, got = ref.generate(ids, attention_mask=mask, **kw), model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert len(set(want.sequences[1, ids.shape[1]:].tolist())) > 1  # not a constant row
    for a, b in zip(got.logits, want.logits):
        assert max_rel(a, b) <= 1e-5


@pytest.mark.parametrize("kw", [
    dict(num_beams=3, do_sample=False),
    dict(num_beams=3, num_return_sequences=2, do_sample=False),
    dict(do_sample=True, top_k=20, temperature=0.8, num_return_sequences=2),
], ids=["beam", "beam-return-2", "sample"])
def test_beam_search_and_sampling_match_transformers(kw):
    ref = hf_model("v3")
    model = patched(ref)
    ids, mask = left_padded(prompts([5, 8]))
    torch.manual_seed(3)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, **kw)
    torch.manual_seed(3)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=6, **kw)
    assert torch.equal(got, want)


def test_a_reused_cache_continues_a_conversation():
    ref = hf_model("v3")
    model = patched(ref)
    ids, mask = left_padded(prompts([5, 9]))
    cache = LatentAttentionCache(model)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **{CACHE: cache})
    turn = torch.cat([first, torch.stack(prompts([3, 3], seed=7))], dim=1)
    turn_mask = torch.cat([mask, torch.ones(2, turn.shape[1] - ids.shape[1], dtype=torch.long)], dim=1)
    kw = dict(attention_mask=turn_mask, max_new_tokens=4, do_sample=False)
    continued = model.generate(turn, **kw, **{CACHE: cache})
    assert torch.equal(continued, model.generate(turn, **kw))  # from scratch
    assert torch.equal(continued, ref.generate(turn, **kw))
    assert cache.get_seq_length() == continued.shape[1] - 1


def test_a_reused_cache_continues_after_a_row_of_padding_only_as_transformers_cache_does():
    """The first generate numbers an all-padding row's first real token 1, a second generate on the
    same cache numbers the row's new tokens from the whole mask (cumsum - 1). The cache holds each
    token's RoPE key at the position it was given, as transformers' own cache does, so every turn is
    the stock model's on its own reused cache."""
    ref = hf_model("v3")
    with torch.no_grad():
        ref.model.embed_tokens.weight[0].normal_()
    model = patched(ref)
    ids, mask = left_padded(prompts([5, 1, 8]))
    ids[1], mask[1] = 0, 0  # the middle row: all padding
    cache, ref_cache = LatentAttentionCache(model), transformers.DynamicCache(config=ref.config)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False)
    first = model.generate(ids, **kw, **{CACHE: cache})
    assert torch.equal(first, ref.generate(ids, **kw, **{CACHE: ref_cache}))
    turn = first
    for seed in (7, 8):
        turn = torch.cat([turn, torch.stack(prompts([3, 3, 3], seed=seed))], dim=1)
        kw["attention_mask"] = torch.cat([mask, torch.ones(3, turn.shape[1] - ids.shape[1], dtype=torch.long)], dim=1)
        got = model.generate(turn, **kw, **{CACHE: cache})
        assert torch.equal(got, ref.generate(turn, **kw, **{CACHE: ref_cache})), seed
        turn = got


def test_an_empty_dynamic_cache_is_adopted_and_a_filled_one_refused():
    ref = hf_model("v3")
    model = patched(ref)
    ids = torch.stack(prompts([6]))
    cache = transformers.DynamicCache()
    out = model.generate(ids, max_new_tokens=3, do_sample=False, **{CACHE: cache})
    assert torch.equal(out, ref.generate(ids, max_new_tokens=3, do_sample=False))
    assert type(cache.layers[0]).__name__ == "LatentCacheLayer"
    filled = transformers.DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(ids, use_cache=True, **{CACHE: filled})
    with pytest.raises(ValueError, match="already holds .* tokens of transformers' keys and values"):
        model(ids, use_cache=True, **{CACHE: filled})


def test_crop_rolls_each_sequence_back():
    model = patched(hf_model("v3"))
    ids, mask = left_padded(prompts([4, 9]))
    ext = torch.stack(prompts([5, 5], seed=4))
    full_mask = torch.cat([mask, torch.ones_like(ext)], dim=1)
    cache = LatentAttentionCache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, **{CACHE: cache})
        want = model(ext, attention_mask=full_mask, **{CACHE: cache}).logits
        cache.crop(-5)
        assert cache.get_seq_length() == ids.shape[1]
        got = model(ext, attention_mask=full_mask, **{CACHE: cache}).logits
    assert max_rel(got, want) <= 1e-12


def test_crop_to_no_columns_then_a_new_prompt_generates_as_transformers():
    """A row of padding only cropped away with the rest: the emptied cache takes a new prompt."""
    ref = hf_model("v3")
    model = patched(ref)
    ids, mask = left_padded(prompts([5, 1, 8]))
    ids[1], mask[1] = 0, 0  # the middle row: all padding
    cache = LatentAttentionCache(model)
    model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, **{CACHE: cache})
    cache.crop(-2)
    assert cache.get_seq_length() == ids.shape[1] + 1
    cache.crop(-cache.get_seq_length())
    assert cache.get_seq_length() == 0
    new_ids, new_mask = left_padded(prompts([3, 6, 2], seed=9))
    kw = dict(attention_mask=new_mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(new_ids, **kw, **{CACHE: cache}), ref.generate(new_ids, **kw))


def test_prompt_lookup_decoding_crops_and_matches_greedy():
    ref = hf_model("v3")
    model = patched(ref)
    ids = torch.stack(prompts([12]))
    ids = torch.cat([ids, ids], dim=1)  # repeats, so prompt lookup proposes tokens and rejected ones are cropped
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=VOCAB - 1)  # transformers 5.0's lookup needs an eos id
    want = ref.generate(ids, **kw)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=3, **kw), want)


# -- kv formats, eviction, the cache's size --------------------------------------------------------

def test_cache_bytes_per_token_are_the_latent_row():
    model = patched(hf_model("v3", dtype=torch.float32))
    cache = LatentAttentionCache(model)
    model.generate(torch.stack(prompts([6])), max_new_tokens=2, do_sample=False, **{CACHE: cache})
    assert cache.bytes_per_token == 3 * (32 + 8) * 4  # 3 layers of [c; k_rope] in float32, no QK norm: no scalars


@pytest.mark.parametrize("kv_format", ["int8", "int4"])
def test_quantized_latent_decodes_close_to_dense(kv_format):
    dense = patched(hf_model("v3", dtype=torch.float32))
    quant = patched(hf_model("v3", dtype=torch.float32), kv_format=kv_format)
    ids = torch.stack(prompts([10, 10]))
    want, fed = stepwise_logits(dense, ids, steps=4)
    cache = LatentAttentionCache(quant)
    got, _ = stepwise_logits(quant, ids, steps=4, tokens=fed, cache=cache)
    assert cache.layers[0].latent.kv_format == kv_format
    assert cache.bytes_per_token < LatentAttentionCache(dense).layers[0].config.kv_lora_rank * 4 * 3
    assert max_rel(got[0], want[0]) <= 1e-5  # the prefill attends over exact keys
    for a, b in zip(got[1:], want[1:]):  # decode steps read the quantized latents
        assert 0 < max_rel(a, b) <= (0.05 if kv_format == "int8" else 0.3)


def test_eviction_policy_bounds_every_layer_cache():
    model = patched(hf_model("v3"), policy=StreamingLLM(sinks=2, budget=8))
    cache = LatentAttentionCache(model)
    out = model.generate(torch.stack(prompts([12, 12])), max_new_tokens=6, do_sample=False, **{CACHE: cache})
    assert out.shape == (2, 18)
    for layer in cache.layers:
        assert int(layer.latent.seqlens.max()) <= 8
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(-1)


def test_snapkv_with_left_padding_keeps_its_fraction_of_real_tokens():
    model = patched(hf_model("v3"), policy=SnapKV(kept_fraction=0.5, window=2))
    ids, mask = left_padded(prompts([6, 16]))
    cache = LatentAttentionCache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, **{CACHE: cache})
    assert cache.layers[0].latent.seqlens.tolist() == [3, 8]


# -- bad input ------------------------------------------------------------------------------------

def test_cache_reused_with_another_batch_size_is_refused():
    model = patched(hf_model("v3"))
    cache = LatentAttentionCache(model)
    model.generate(torch.stack(prompts([4, 4])), max_new_tokens=2, do_sample=False, **{CACHE: cache})
    with pytest.raises(ValueError, match="holds 2 sequences and this input has 3"):
        model.generate(torch.stack(prompts([6, 6, 6])), max_new_tokens=2, **{CACHE: cache})


def test_fixed_capacity_is_checked_before_any_work():
    model = patched(hf_model("v3"))
    cache = LatentAttentionCache(model, max_cache_len=8)
    with pytest.raises(ValueError, match="max_cache_len: this cache holds 8 tokens per sequence.*would hold 10"):
        with torch.no_grad():
            model(torch.stack(prompts([10])), **{CACHE: cache})
    assert cache.get_seq_length() == 0 and cache.layers[0].latent is None
    with pytest.raises(ValueError, match="max_cache_len: expected a positive int"):
        LatentAttentionCache(model, max_cache_len=0)


def test_masks_and_options_the_latent_path_cannot_serve_are_refused():
    model = patched(hf_model("v3"))
    ids = torch.stack(prompts([5]))
    with pytest.raises(ValueError, match="attention_mask: .*2-D padding mask"):
        model(ids, attention_mask=torch.ones(1, 5, 5))
    with pytest.raises(ValueError, match="attention_mask: an additive 4-D mask's entries must be 0"):
        model(ids, attention_mask=torch.ones(1, 1, 5, 5))
    with pytest.raises(ValueError, match=r"position_ids: expected shape \[batch=1, 5\]"):
        model(ids, position_ids=torch.arange(4)[None], **{CACHE: LatentAttentionCache(model)})
    with pytest.raises(ValueError, match="static cache|StaticLayer"):
        model(ids, **{CACHE: transformers.StaticCache(config=model.config, max_cache_len=16, offloading=True)})


def test_a_cache_needs_a_patched_model():
    with pytest.raises(ValueError, match="apply_latent_attention"):
        LatentAttentionCache(hf_model("v3"))


def test_a_layer_whose_weights_disagree_with_the_config_is_refused():
    model = hf_model("v3")
    model.model.layers[2].self_attn.kv_b_proj = torch.nn.Linear(32, 7, bias=False, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"projections: kv_b_proj.weight has shape \(7, 32\), this config needs "
                                         r"\(128, 32\)"):
        apply_latent_attention(model)


# -- what a call carries, and what it leaves behind -------------------------------------------------

@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_with_padding_matches_transformers(reentrant):
    ref = hf_model("v3").train()
    model = patched(ref).train()
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids, mask = left_padded(prompts([5, 12]))
    labels = ids.masked_fill(mask == 0, -100)
    losses = [m(ids, attention_mask=mask, labels=labels).loss for m in (ref, model)]
    for loss in losses:
        loss.backward()
    assert abs(losses[1].item() - losses[0].item()) <= 1e-6 * losses[0].item()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert max_rel(p.grad, q.grad) <= 1e-5, name


def test_a_nested_call_leaves_the_outer_call_alone():
    model = patched(hf_model("v3"))
    ids, mask = left_padded(prompts([4, 10]))
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        nested = []

        def call_the_model_again(*_):
            if not nested:  # once: the nested call passes through this layer too
                nested.append(True)
                model(torch.stack(prompts([3], seed=9)))

        hook = model.model.layers[1].register_forward_pre_hook(call_the_model_again)
        try:
            got = model(ids, attention_mask=mask).logits
        finally:
            hook.remove()
    assert torch.equal(got[mask.bool()], want[mask.bool()])


def test_a_mask_covering_more_columns_than_the_call_is_read_from_the_start():
    model = patched(hf_model("v3"))
    ids, mask = left_padded(prompts([7, 14]))
    with torch.no_grad():
        want = model(ids, attention_mask=mask, **{CACHE: LatentAttentionCache(model)}).logits
        cache = LatentAttentionCache(model)
        got = torch.cat([model(ids[:, s:s + 5], attention_mask=mask, **{CACHE: cache}).logits  # the whole mask each time
                         for s in range(0, ids.shape[1], 5)], dim=1)
    # Chunks go through the absorbed path, the one-shot prefill through the explicit one: equal to
    # float64 roundoff in qkmla, but transformers' RMSNorms round to float32 even in a float64 model,
    # so a last-bit difference can come out as a float32 rounding step.
    assert max_rel(got[mask.bool()], want[mask.bool()]) <= 1e-7
    with pytest.raises(ValueError, match=r"attention_mask: expected \[batch=2, at least 19\]"):
        model(ids[:, :5], attention_mask=mask[:, :3], **{CACHE: cache})


def test_an_adapter_on_kv_b_proj_is_refused_before_the_absorbed_path_reads_its_weight():
    class Adapter(torch.nn.Module):  # what PEFT's LoRA layer looks like to qkmla: a weight, and more
        def __init__(self, base):
            super().__init__()
            self.base, self.extra = base, torch.nn.Linear(base.in_features, base.out_features, bias=False,
                                                          dtype=base.weight.dtype)

        @property
        def weight(self):
            return self.base.weight

        def forward(self, x):
            return self.base(x) + self.extra(x)

    model = patched(hf_model("v3"))
    attn = latent_layers(model)[0]
    attn.kv_b_proj = Adapter(attn.kv_b_proj)
    with pytest.raises(ValueError, match="kv_b_proj: the absorbed path reads kv_b_proj.weight.*merge_and_unload"):
        model.generate(torch.stack(prompts([5])), max_new_tokens=2)


def test_reset_frees_the_cache_for_another_batch():
    model = patched(hf_model("v3"))
    cache = LatentAttentionCache(model)
    model.generate(torch.stack(prompts([4, 4])), max_new_tokens=2, do_sample=False, **{CACHE: cache})
    cache.reset()
    ids = torch.stack(prompts([6, 6, 6], seed=5))
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False, **{CACHE: cache}),
                       model.generate(ids, max_new_tokens=3, do_sample=False))


def test_generation_under_inference_mode_does_not_block_training_after_it():
    model = patched(hf_model("v3"))
    ids = torch.stack(prompts([6]))
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, do_sample=False)
    model.train()
    out = model(ids, labels=ids, use_cache=True, **{CACHE: LatentAttentionCache(model)})
    out.loss.backward()  # the cached path reads the absorbed weights derived under inference mode above
    assert latent_layers(model)[0].kv_b_proj.weight.grad is not None


def test_a_growing_cache_matches_one_big_enough_from_the_start(monkeypatch):
    from qkmla.integrations.transformers import cache as hf_cache

    model = patched(hf_model("v3"))
    ids, mask = left_padded(prompts([5, 11]))
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
              output_logits=True)
    want = model.generate(ids, **kw, **{CACHE: LatentAttentionCache(model, max_cache_len=64)})
    monkeypatch.setattr(hf_cache, "GROW", 4)
    cache = LatentAttentionCache(model)
    got = model.generate(ids, **kw, **{CACHE: cache})
    assert cache.layers[0].latent.capacity >= 23 and torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert torch.equal(a, b)


def test_assisted_decoding_matches_greedy():
    ref = hf_model("v3")
    model = patched(ref)
    assistant = patched(hf_model("v3", seed=4))
    ids = torch.stack(prompts([9]))
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=VOCAB - 1)
    assert torch.equal(model.generate(ids, assistant_model=assistant, **kw), ref.generate(ids, **kw))


def test_bfloat16_error_is_no_larger_than_transformers_own():
    ref64 = hf_model("v3")
    ref16 = copy.deepcopy(ref64).to(torch.bfloat16)
    ours16 = patched(ref16)
    ids = torch.stack(prompts([12, 12]))
    want, fed = stepwise_logits(ref64, ids, steps=4)
    theirs, _ = stepwise_logits(ref16, ids, steps=4, tokens=fed)
    ours, _ = stepwise_logits(ours16, ids, steps=4, tokens=fed, cache=LatentAttentionCache(ours16))
    for w, t, o in zip(want, theirs, ours):
        assert max_rel(o.double(), w) <= 2 * max_rel(t.double(), w) + 1e-3


def test_threads_generating_on_one_model_each_get_their_own_answer():
    import threading

    model = patched(hf_model("v3"))
    batches = [left_padded(prompts([3, 9], seed=s)) for s in range(4)]
    kw = dict(max_new_tokens=4, do_sample=False)
    want = [model.generate(ids, attention_mask=mask, **kw) for ids, mask in batches]
    got = [None] * len(batches)

    def run(i):
        got[i] = model.generate(batches[i][0], attention_mask=batches[i][1], **kw)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(g, w) for g, w in zip(got, want))
