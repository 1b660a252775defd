"""Shared-KV attention (DeepSeek-V4): shapes and norms, causality, position invariance from the
output's RoPE slice rotated back, the sink, decoding over its cache against the full forward, and
transformers' own DeepseekV4Attention (sliding-window layer) on the same weights."""

import pytest
import torch

from qkmla.attention.functional import sdpa, sink_attention
from qkmla.attention.shared_kv import SharedKVAttention
from qkmla.cache.full import FullKVCache
from qkmla.cache.shared_kv import SharedKVCache
from qkmla.config import SharedKVConfig

CFG = SharedKVConfig(hidden_size=48, num_heads=3, head_dim=20, rope_head_dim=6, q_lora_rank=12)


def _layer(cfg=CFG, seed=0, std=0.3):
    torch.manual_seed(seed)
    attn = SharedKVAttention(cfg).double()
    with torch.no_grad():
        for p in attn.parameters():  # off the constant inits, so a norm weight or a sink that is ignored shows
            p.normal_(0, std)
    return attn


@pytest.mark.parametrize("q_lora_rank", [12, None], ids=["qlora", "direct-q"])
def test_shapes_and_the_norms(q_lora_rank):
    cfg = CFG.replace(q_lora_rank=q_lora_rank, norm_eps=0.0)  # eps 0: exactly unit RMS
    attn = _layer(cfg)
    x = torch.randn(2, 7, 48, dtype=torch.float64)
    pos = torch.arange(7).expand(2, 7)
    q, kv = attn.query(x, pos), attn.shared_kv(x, pos)
    assert attn(x).shape == (2, 7, 48) and q.shape == (2, 7, 3, 20) and kv.shape == (2, 7, 1, 20)
    # RoPE rotates pairs: each head's query keeps unit RMS, the shared vector the kv_norm's output length
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(2, 7, 3, dtype=torch.float64))
    raw = attn.kv_norm(attn.kv_proj(x))
    torch.testing.assert_close(kv.squeeze(2).norm(dim=-1), raw.norm(dim=-1))
    assert not hasattr(attn, "q_proj") if q_lora_rank else not hasattr(attn, "q_a_proj")


def test_causal():
    attn = _layer()
    x = torch.randn(1, 9, 48, dtype=torch.float64)
    y = attn(x)
    x2 = x.clone()
    x2[:, 5:] = torch.randn(1, 4, 48, dtype=torch.float64)
    y2 = attn(x2)
    torch.testing.assert_close(y2[:, :5], y[:, :5], rtol=0, atol=1e-13)
    assert (y2[:, 5:] - y[:, 5:]).abs().max() > 1e-3


@pytest.mark.parametrize("sinks", [True, False])
def test_output_depends_on_relative_positions_only(sinks):
    """The values carry RoPE on their last d_r dims; rotating the output's slice back by the
    query's position (V4) leaves a function of distances: shifting every position changes nothing."""
    attn = _layer(CFG.replace(attention_sinks=sinks))
    x = torch.randn(2, 6, 48, dtype=torch.float64)
    shifted = attn(x, positions=torch.arange(6) + 37)
    torch.testing.assert_close(shifted, attn(x), rtol=0, atol=1e-12)


def test_sink_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 5, 3, 4, dtype=torch.float64), torch.randn(2, 5, 1, 4, dtype=torch.float64), \
        torch.randn(2, 5, 1, 6, dtype=torch.float64)
    never = torch.full((3,), float("-inf"), dtype=torch.float64)
    torch.testing.assert_close(sink_attention(q, k, v, 0.5, never, causal=True), sdpa(q, k, v, 0.5, causal=True))
    sinks = torch.tensor([0.0, 2.0, -1.0], dtype=torch.float64)
    out = sink_attention(q, k, v, 0.5, sinks, causal=True)
    b, t, hh = 1, 3, 1  # one output by hand: exp(l_s) / (exp(sink) + sum exp(l)) over the keys s <= t
    logits = 0.5 * k[b, :t + 1, 0] @ q[b, t, hh]
    w = logits.exp() / (sinks[hh].exp() + logits.exp().sum())
    torch.testing.assert_close(out[b, t, hh], w @ v[b, :t + 1, 0])
    mask = torch.ones(2, 5, 5, dtype=torch.bool).tril()
    mask[1, 2] = False  # a query that sees nothing: all its weight on the sink
    masked = sink_attention(q, k, v, 0.5, sinks, mask=mask)
    assert bool((masked[1, 2] == 0).all())
    torch.testing.assert_close(masked[0], out[0])


@pytest.mark.parametrize("sinks", [True, False])
def test_decode_over_the_cache_equals_the_full_forward(sinks):
    attn = _layer(CFG.replace(attention_sinks=sinks)).eval()
    x = torch.randn(2, 12, 48, dtype=torch.float64)
    full = attn(x)
    cache = SharedKVCache.from_config(attn.config, 2, 12, dtype=torch.float64)
    pieces = [attn(x[:, :5], cache)] + [attn(x[:, t:t + 1], cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=0, atol=1e-12)
    assert cache.read("kv").shape == (2, 12, 20)
    # right-padded prefill: each sequence's real tokens give what it gives alone
    cache = SharedKVCache.from_config(attn.config, 2, 12, dtype=torch.float64)
    y = attn(x[:, :6], cache, input_lengths=torch.tensor([6, 4]))
    torch.testing.assert_close(y[1, :4], attn(x[1:, :4])[0], rtol=0, atol=1e-12)


def test_bad_config_and_input():
    with pytest.raises(ValueError, match="rope_head_dim: RoPE rotates pairs"):
        SharedKVConfig(rope_head_dim=7)
    with pytest.raises(ValueError, match="rope_head_dim: RoPE rotates the last dims"):
        SharedKVConfig(head_dim=8, rope_head_dim=10)
    with pytest.raises(ValueError, match="attention_sinks"):
        SharedKVConfig(attention_sinks=1)
    with pytest.raises(ValueError, match="q_lora_rank"):
        SharedKVConfig(q_lora_rank=0)
    with pytest.raises(ValueError, match="config: expected a SharedKVConfig"):
        SharedKVAttention(object())
    attn = SharedKVAttention(CFG)
    with pytest.raises(ValueError, match="cache: expected a SharedKVCache"):
        attn(torch.randn(1, 2, 48), FullKVCache(1, 4, 1, 20, 20))
    with pytest.raises(ValueError, match="head_dim=20"):
        attn(torch.randn(1, 2, 48), SharedKVCache(1, 4, 16))
    with pytest.raises(ValueError, match="input_lengths"):
        attn(torch.randn(1, 2, 48), input_lengths=torch.tensor([1]))


def test_matches_transformers_deepseek_v4_attention():
    """transformers' DeepseekV4Attention on a sliding-window layer whose window covers the
    sequence, with its grouped output projection made one group with an identity first
    factor, on our weights: the same outputs. (It computes its norms and RoPE in float32.)"""
    m4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    h, D, d_r, d, r, T = 3, 20, 6, 48, 12, 10
    cfg = DeepseekV4Config(hidden_size=d, num_attention_heads=h, head_dim=D, q_lora_rank=r,
                           partial_rotary_factor=d_r / D, num_hidden_layers=1, layer_types=["sliding_attention"],
                           sliding_window=T, o_groups=1, o_lora_rank=h * D, vocab_size=32, n_routed_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=8, index_n_heads=2, index_head_dim=8)
    cfg._attn_implementation = "eager"
    ours = _layer().float()
    ref = m4.DeepseekV4Attention(cfg, 0)
    with torch.no_grad():
        for name in ("q_a_proj", "q_a_norm", "q_b_proj", "kv_proj", "kv_norm"):
            getattr(ref, name).weight.copy_(getattr(ours, name).weight)
        ref.sinks.copy_(ours.sinks)
        ref.o_a_proj.weight.copy_(torch.eye(h * D))
        ref.o_b_proj.weight.copy_(ours.o_proj.weight)
    x = torch.randn(2, T, d)
    pos = torch.arange(T).expand(2, T)
    rot = m4.DeepseekV4RotaryEmbedding(cfg)
    pe = {k: rot(x, pos, layer_type=k) for k in rot.layer_types}
    mask = torch.full((T, T), float("-inf")).triu(1).expand(2, 1, T, T)
    expected, _ = ref(x, pe, pos, mask)
    torch.testing.assert_close(ours(x), expected, rtol=1e-5, atol=1e-5)
