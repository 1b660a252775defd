import pytest
import torch

from qkmla import AttentionConfig, FullKVCache, MultiHeadAttention, QKNormConfig
from qkmla.cli.verify import perturb_vectors

VARIANTS = {
    "mha": dict(num_kv_heads=4),
    "gqa-rms": dict(num_kv_heads=2, qk_norm="rms"),
    "mqa-l2": dict(num_kv_heads=1, qk_norm=QKNormConfig("l2", learnable_logit_scale=True), softmax_scale=10.0),
    "gqa-lp3": dict(num_kv_heads=2, qk_norm=QKNormConfig("lp", p=3.0)),
}


def make(kw) -> MultiHeadAttention:
    return perturb_vectors(MultiHeadAttention(AttentionConfig(hidden_size=32, num_heads=4, **kw))).double().eval()


def naive_attention(attn: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """Written from the formulas: per-head norm, RoPE, softmax(scale q k^T) v, heads share KV groups."""
    c = attn.config
    pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    q, k, v = attn.qkv(x, pos)
    rep = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scale = attn.scale if isinstance(attn.scale, float) else attn.scale[:, None, None]
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    s = s.masked_fill(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v)
    return attn.o_proj(o.flatten(2))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_naive_attention(name):
    attn = make(VARIANTS[name])
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    torch.testing.assert_close(attn(x), naive_attention(attn, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_with_cache_equal_logits_without(name):
    attn = make(VARIANTS[name])
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    cache = FullKVCache.from_config(attn.config, 2, 16, dtype=torch.float64, fill=float("nan"))
    got = torch.cat([attn(x[:, :4], cache)] + [attn(x[:, t:t + 1], cache) for t in range(4, 11)], 1)
    torch.testing.assert_close(got, attn(x), rtol=1e-10, atol=1e-10)


def test_qk_norm_applied_per_head_before_rope():
    attn = make(dict(num_kv_heads=2, qk_norm=QKNormConfig("rms", eps=0.0)))
    x = torch.randn(1, 3, 32, dtype=torch.float64)
    q, _, _ = attn.qkv(x * 1000, torch.arange(3)[None])  # a scaled input gives the same normalized q
    q0, _, _ = attn.qkv(x, torch.arange(3)[None])
    torch.testing.assert_close(q, q0, rtol=1e-8, atol=1e-8)


def test_gradients_reach_every_weight():
    attn = make(dict(num_kv_heads=2, qk_norm=QKNormConfig("rms", learnable_logit_scale=True)))
    attn(torch.randn(2, 5, 32, dtype=torch.float64)).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in attn.parameters())


def test_bad_inputs():
    attn = MultiHeadAttention(AttentionConfig(hidden_size=32, num_heads=4, num_kv_heads=2))
    with pytest.raises(ValueError, match="x: expected shape"):
        attn(torch.randn(2, 3, 31))
    with pytest.raises(ValueError, match="cache: FullKVCache"):
        attn(torch.randn(1, 1, 32), FullKVCache(1, 4, num_kv_heads=4, k_dim=8, v_dim=8))
    with pytest.raises(ValueError, match="cache: expected a FullKVCache"):
        attn(torch.randn(1, 1, 32), cache="kv")
    with pytest.raises(ValueError, match="input_lengths: only meaningful with a cache"):
        attn(torch.randn(1, 1, 32), input_lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="x: dtype torch.float64 does not match"):
        attn(torch.randn(1, 1, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="config"):
        MultiHeadAttention({"hidden_size": 32})


def test_what_the_padding_holds_never_reaches_a_real_token():
    """Issue 27, class 3: NaN right padding leaves every real output as zero padding leaves it."""
    attn = make(VARIANTS["gqa-rms"])
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    lengths = torch.tensor([5, 2])
    outs = []
    for fill in (0.0, float("nan")):
        xp = x.clone()
        xp[1, 2:] = fill
        cache = FullKVCache.from_config(attn.config, 2, 8, dtype=torch.float64)
        pre = attn(xp, cache, input_lengths=lengths)
        outs.append(torch.cat([pre[0], pre[1, :2], attn(x[:, :1], cache).flatten(0, 1)]))
    assert not outs[1].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def test_the_structure_of_a_built_module_is_fixed():
    attn = make(VARIANTS["gqa-rms"])
    with pytest.raises(ValueError, match=r"config: \['qk_norm'\] are fixed when the module is built"):
        attn.config = attn.config.replace(qk_norm="l2")
    with pytest.raises(ValueError, match=r"state_dict: q_norm\._extra_state says these weights belong to a rms QK "
                                         r"norm, but this module's is l2"):
        make(dict(VARIANTS["gqa-rms"], qk_norm="l2")).load_state_dict(attn.state_dict())
