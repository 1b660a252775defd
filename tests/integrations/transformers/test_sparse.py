"""DeepSeek-V3.2's sparse attention (its lightning indexer's top-k) through ``apply_latent_attention``.

Random models from transformers' own ``DeepseekV32Config`` (2 layers: one dense MLP, one MoE),
``index_topk`` = 4 against prompts of 12 tokens and more, so each query attends to a real subset of
the tokens before it (:func:`test_the_selection_is_real` checks that it changes the logits). The
bounds are ``test_model.py``'s: transformers computes its RoPE tables in float32 even in a float64
model, which bounds the difference of the two models' logits (1e-5 of the largest logit in float64;
1e-4 in float32, where both round everything).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV32ForCausalLM"):
    pytest.skip("DeepSeek-V3.2 is not in this transformers", allow_module_level=True)

import qkmla.attention.mla as mla_module  # noqa: E402
from qkmla.cache import StreamingLLM  # noqa: E402
from qkmla.integrations.transformers import LatentAttentionCache, apply_latent_attention  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402
from qkmla.integrations.transformers.sparse import SparseLatentAttention  # noqa: E402
from qkmla.integrations.transformers.sparse_cache import SparseLatentCacheLayer, column_slots  # noqa: E402

from .helpers import CACHE, max_rel, stepwise_logits  # noqa: E402

VOCAB = 97
TOPK = 4
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, index_topk=TOPK, index_head_dim=16, index_n_heads=4,
             n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
             first_k_dense_replace=1, max_position_embeddings=256, pad_token_id=0, bos_token_id=None,
             eos_token_id=None, experts_implementation="eager", rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 100.0})


def v32_model(dtype=torch.float64, seed: int = 0, **config):
    """A random V3.2 model (eval mode) with weights and norms away from their init, so attention and
    the indexer's scores are not flat."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**{**SHAPE, **config})).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif "self_attn" in name and p.dim() == 2:
                p.mul_(3.0)
    return model.eval()


def patched(model, **kwargs):
    return apply_latent_attention(copy.deepcopy(model), **kwargs)


def prompts(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


BOUND = {torch.float64: 1e-5, torch.float32: 1e-4}


# -- parity with the unpatched model -------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_prefill_and_every_decode_step_match_transformers(dtype):
    ref = v32_model(dtype)
    model = patched(ref)
    ids = prompts(2, 12)
    want, fed = stepwise_logits(ref, ids, steps=6)
    got, fed_ours = stepwise_logits(model, ids, steps=6, cache=LatentAttentionCache(model))
    assert torch.equal(fed_ours, fed)  # greedy tokens identical
    for step, (a, b) in enumerate(zip(got, want)):
        assert max_rel(a, b) <= BOUND[dtype], (step, max_rel(a, b))


def test_the_selection_is_real():
    """The same weights with a top-k covering the whole context give other logits: the parity above
    is over a real subset of the tokens."""
    ids = prompts(2, 12)
    sparse, dense = v32_model(), v32_model(index_topk=64)
    with torch.no_grad():
        a, b = sparse(ids, use_cache=False).logits, dense(ids, use_cache=False).logits
    assert max_rel(a[:, TOPK:], b[:, TOPK:]) > 1e-2
    assert max_rel(a[:, :TOPK], b[:, :TOPK]) <= 1e-12  # the first TOPK tokens see every token before them


def test_padded_batch_generates_what_transformers_generates():
    ref = v32_model(torch.float32)
    model = patched(ref)
    ids = prompts(2, 13)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ids[0, :5] = 0
    kw = dict(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want, got = ref.generate(ids, attention_mask=mask, **kw), model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert max_rel(a, b) <= 1e-4
    assert all(isinstance(layer, SparseLatentCacheLayer) for layer in getattr(got, CACHE, got.past_key_values).layers)


def test_beam_search_reorders_the_indexer_keys_with_the_rows():
    ref = v32_model(torch.float32)
    model = patched(ref)
    ids = prompts(1, 10)
    kw = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_no_cache_forward_and_loss_match_transformers():
    ref = v32_model()
    model = patched(ref)
    ids = prompts(2, 16)
    with torch.no_grad():
        a, b = ref(ids, use_cache=False).logits, model(ids, use_cache=False).logits
    assert max_rel(b, a) <= 1e-5
    loss_ref, loss = ref(ids, labels=ids).loss, model(ids, labels=ids, use_cache=False).loss
    assert abs(loss.item() - loss_ref.item()) <= 1e-6 * loss_ref.item()


# -- the absorbed sparse decode ------------------------------------------------------------------

def test_decode_reads_the_selected_rows_through_the_op(monkeypatch):
    """Each decode step hands the op the indexer's choice: TOPK slots per query, each a real cached slot."""
    model = patched(v32_model())
    seen = []
    op = mla_module.mla_decode_with_kvcache

    def spy(*args, **kwargs):
        seen.append((kwargs["indices"], kwargs["cache_seqlens"]))
        return op(*args, **kwargs)

    monkeypatch.setattr(mla_module, "mla_decode_with_kvcache", spy)
    stepwise_logits(model, prompts(2, 12), steps=3, cache=LatentAttentionCache(model))
    assert len(seen) == 3 * 2  # three steps, two layers; the prefill took the explicit path
    for indices, seqlens in seen:
        assert indices.shape == (2, 1, TOPK)
        assert bool((indices >= 0).all()) and bool((indices < seqlens[:, None, None]).all())
        assert bool((indices.sort(dim=-1).values.diff(dim=-1) > 0).all())  # distinct slots


def test_a_prefill_chunk_is_expanded_where_cheaper_and_matches_transformers(monkeypatch):
    """A second prefill chunk over a context short against topk goes down the expand path
    (paths.cheaper_cached_path), the next decode step down the absorbed one; logits equal
    transformers' chunked prefill's (float64)."""
    model = v32_model(index_topk=64)
    ids = prompts(2, 33)
    paths = []
    attend = mla_module.MLA._attend_latent
    monkeypatch.setattr(mla_module.MLA, "_attend_latent",
                        lambda self, x, cache, slot, path, indices=None: paths.append(path) or
                        attend(self, x, cache, slot, path, indices))
    logits = {}
    for name, m in (("transformers", model), ("qkmla", patched(model))):
        with torch.no_grad():
            out = m(input_ids=ids[:, :8], use_cache=True)
            cache = getattr(out, CACHE, None) or out.past_key_values
            chunk = m(input_ids=ids[:, 8:32], use_cache=True, **{CACHE: cache}).logits
            step = m(input_ids=ids[:, 32:], use_cache=True, **{CACHE: cache}).logits
        logits[name] = torch.cat((chunk, step), dim=1)
    assert paths == ["explicit"] * 2 + ["expand"] * 2 + ["absorbed"] * 2  # two layers each
    assert max_rel(logits["qkmla"], logits["transformers"]) < BOUND[torch.float64]


def test_the_indexer_and_the_query_share_one_query_projection():
    """Each call projects the hidden states through q_a_proj once per layer, as transformers' own layer
    does (the indexer's query input is the query's latent), with and without a cache."""
    model = patched(v32_model())
    calls = []
    for layer in latent_layers(model):
        layer.q_a_proj.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[1]))
    stepwise_logits(model, prompts(2, 12), steps=2, cache=LatentAttentionCache(model))
    assert calls == [12, 12, 1, 1, 1, 1]  # the prefill, then two steps; two layers each
    calls.clear()
    with torch.no_grad():
        model(prompts(2, 12))
    assert calls == [12, 12]
    assert all(layer._query_input is None for layer in latent_layers(model))  # nothing kept after the call


@pytest.mark.parametrize("kv_format", ["dense", "int8"])
def test_qk_normed_sparse_decode_equals_its_explicit_path(kv_format):
    """With the paper's QK norm added (weights away from ones), the absorbed sparse decode (latent
    rows and key scalars gathered with the indexer's indices) equals the same model's explicit
    path over the whole sequence, no cache, at the prefill and every step."""
    model = patched(v32_model(), qk_norm="rms")
    with torch.no_grad():
        for attn in latent_layers(model):
            for qk in (attn.q_norm, attn.k_norm):
                for norm in (qk.content, qk.rope):
                    norm.weight.add_(0.3 * torch.randn_like(norm.weight))
    ids = prompts(2, 12)
    cache = LatentAttentionCache(model, kv_format=kv_format)
    got, fed = stepwise_logits(model, ids, steps=5, cache=cache)
    full = torch.cat((ids, fed), dim=1)
    with torch.no_grad():
        explicit = model(full, use_cache=False).logits
    # transformers' RMSNorms round to float32 even in a float64 model, so the two paths' roundoff
    # reaches the logits at float32's (about 1e-8 seen); int8 rows: the decode reads quantized latents.
    bound = 1e-6 if kv_format == "dense" else 5e-2
    for step, logits in enumerate(got):
        assert max_rel(logits, explicit[:, ids.shape[1] - 1 + step]) <= bound, step
    if kv_format == "dense":
        assert all(attn.k_norm is not None for attn in latent_layers(model))


def test_column_slots_map_columns_to_latent_slots_skipping_padding():
    columns = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    visible = columns[:, None, :].expand(2, 1, 5)
    chosen = torch.tensor([[[4, 0, 2]], [[4, 0, 2]]])
    assert column_slots(columns, visible, chosen).tolist() == [[[2, -1, 0]], [[4, 0, 2]]]


# -- what is refused ---------------------------------------------------------------------------

def test_module_swap_keeps_the_indexer_and_the_state_dict():
    ref = v32_model()
    model = patched(ref)
    assert list(model.state_dict()) == list(ref.state_dict())
    attn = latent_layers(model)[0]
    assert isinstance(attn, SparseLatentAttention)
    assert attn.indexer is model.model.layers[0].self_attn.indexer
    assert type(attn.indexer).__name__ == "DeepseekV32Indexer"


def test_refused_with_the_reason():
    with pytest.raises(ValueError, match="policy: a sparse attention model"):
        patched(v32_model(), policy=StreamingLLM(sinks=2, budget=8))
    model = patched(v32_model())
    with pytest.raises(ValueError, match="output_attentions"):
        model(prompts(1, 6), output_attentions=True)
    with pytest.raises(ValueError, match="cache_implementation: .* static cache of a sparse attention model"):
        model.generate(prompts(1, 6), max_new_tokens=2, cache_implementation="static")
    with pytest.raises(ValueError, match="cache_implementation: a sparse attention model"):
        model(prompts(1, 6), **{CACHE: LatentAttentionCache(model, max_cache_len=16, static=True)})
