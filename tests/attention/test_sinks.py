"""Attention sinks in MLA (``qkmla.attention.sinks``): one learned logit per head in the softmax's
denominator, on the explicit path (the sink as one more key in SDPA) and the absorbed path (the
decode op's log-sum-exp: o * sigmoid(L - s_h)), against a direct softmax with a sink column
(``functional.sink_attention``).

The absorbed path's log-sum-exp is float32 whatever the queries' dtype (the decode op's contract,
FlashMLA's), so in float64 the sinks' share of each output carries float32's roundoff: the paths
agree within 1e-6 there, where without sinks they agree to 1e-10 (test_mla.py).
"""

import pytest
import torch

from qkmla import LatentCache, MLA, MLAConfig, PagedLayout, QKNormConfig
from qkmla.attention.decode import decode_one_token
from qkmla.attention.functional import sdpa, sink_attention
from qkmla.attention.selection import selection_mask
from qkmla.attention.sinks import apply_sinks, sink_gate
from qkmla.cli.verify import perturb_vectors

from .test_selection import random_selection

VARIANTS = {
    "plain": dict(qk_norm=None),
    "rms": dict(qk_norm="rms"),
    "rms-unified-gqa": dict(qk_norm=QKNormConfig("rms", mode="unified"), num_kv_groups=2),
    "learnable-scale": dict(qk_norm=QKNormConfig("l2", learnable_logit_scale=True), softmax_scale=5.0),
}
SINKED = 1e-6  # float32 log-sum-exp on the absorbed path (module docstring)


def sinked(overrides=None, dtype=torch.float64, seed: int = 0) -> MLA:
    """A random MLA with sinks of a few units (each head's keys and its sink both matter)."""
    torch.manual_seed(seed)
    mla = perturb_vectors(MLA(MLAConfig(attention_sinks=True, **(overrides or {})))).to(dtype).eval()
    with torch.no_grad():
        mla.sinks.copy_(1.0 + torch.randn_like(mla.sinks))
    return mla


def reference(mla: MLA, x: torch.Tensor, mask=None) -> torch.Tensor:
    """The explicit path with the direct softmax over the logits and a sink column."""
    positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    q, k, v = mla.explicit_qkv(x, positions)
    heads = sink_attention(q, k, v, mla.scale, mla.sinks, mask=mask, causal=mask is None)
    return mla.project_out(heads, x)


def test_a_plain_model_has_no_sinks_and_its_state_is_unchanged():
    plain, with_sinks = MLA(MLAConfig()), MLA(MLAConfig(attention_sinks=True))
    assert plain.sinks is None and "sinks" not in plain.state_dict()
    assert set(with_sinks.state_dict()) - set(plain.state_dict()) == {"sinks"}
    assert torch.equal(with_sinks.sinks, torch.zeros(plain.config.num_heads))
    with pytest.raises(ValueError, match="attention_sinks: expected True or False, got 'yes'"):
        MLAConfig(attention_sinks="yes")


def test_the_gate_is_the_sink_columns_share():
    """o * sigmoid(L - s) is what a softmax with the sink as one more logit gives."""
    torch.manual_seed(0)
    logits, values, sinks = torch.randn(2, 3, 4, 7, dtype=torch.float64), torch.randn(2, 7, 5, dtype=torch.float64), \
        torch.randn(4, dtype=torch.float64)
    o = torch.einsum("bthj,bjd->bthd", logits.softmax(-1), values)
    with_sink = torch.cat((logits, sinks.view(1, 1, 4, 1).expand(2, 3, 4, 1)), -1).softmax(-1)[..., :-1]
    want = torch.einsum("bthj,bjd->bthd", with_sink, values)
    torch.testing.assert_close(apply_sinks(o, logits.logsumexp(-1), sinks), want, rtol=1e-13, atol=1e-14)
    assert sink_gate(torch.full((1, 1, 4), float("-inf")), sinks.float()).eq(0).all()  # no key: all on the sink


@pytest.mark.parametrize("case", ["causal", "masked", "gqa-per-head-scale"])
def test_sdpa_with_the_sink_as_a_key_is_the_direct_softmax(case):
    torch.manual_seed(1)
    B, T, S, h = 2, 5, 5, 4
    G = 2 if case == "gqa-per-head-scale" else h
    q, k, v = torch.randn(B, T, h, 12), torch.randn(B, S, G, 12), torch.randn(B, S, G, 8)
    q, k, v = (t.double() for t in (q, k, v))
    sinks = torch.randn(h, dtype=torch.float64)
    scale = torch.rand(h, dtype=torch.float64) + 0.2 if G != h else 0.3
    mask = torch.rand(B, T, S) < 0.5 if case == "masked" else None
    if mask is not None:
        mask[0, 1] = False  # a row that sees nothing: all its weight on the sink, output 0
    causal = mask is None
    got = sdpa(q, k, v, scale, mask=mask, causal=causal, sinks=sinks)
    want = sink_attention(q, k, v, scale, sinks, mask=mask, causal=causal)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    if mask is not None:
        assert got[0, 1].eq(0).all()
    assert (got - sdpa(q, k, v, scale, mask=mask, causal=causal)).abs().max() > 1e-2  # the sinks matter


def test_a_sink_of_minus_infinity_is_no_sink():
    mla = sinked()
    x = torch.randn(2, 6, mla.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        mla.sinks.fill_(float("-inf"))
        got = mla(x)
        mla.sinks = None
        torch.testing.assert_close(got, mla(x), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_explicit_path_is_the_direct_softmax_with_a_sink_column(name):
    mla = sinked(VARIANTS[name])
    x = torch.randn(2, 9, mla.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(mla(x), reference(mla, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_absorbed_decode_equals_the_explicit_path_with_sinks(name, layout):
    """Right-padded prompts of uneven lengths (one empty), decoded together over a NaN-filled cache,
    against each sequence alone through the explicit path."""
    mla = sinked(VARIANTS[name])
    lengths, steps, d = [7, 3, 0, 5], 4, mla.config.hidden_size
    B, T = len(lengths), max(lengths)
    prompts = [torch.randn(1, n, d, dtype=torch.float64) for n in lengths]
    new = torch.randn(B, steps, d, dtype=torch.float64)
    padded = torch.zeros(B, T, d, dtype=torch.float64)
    for b, p in enumerate(prompts):
        padded[b, :lengths[b]] = p[0]
    kw = {}
    if layout == "paged":  # shuffled blocks
        kw["layout"] = PagedLayout(block_size=4, block_table=torch.randperm(B * 3).view(B, 3))
    cache = LatentCache.from_config(mla.config, B, 12, dtype=torch.float64, fill=float("nan"), **kw)
    with torch.no_grad():
        pre = mla(padded, cache, input_lengths=torch.tensor(lengths))
        dec = [mla(new[:, t:t + 1], cache, path="absorbed") for t in range(steps)]
        for b, n in enumerate(lengths):
            alone = torch.cat((prompts[b], new[b:b + 1]), dim=1)
            want = reference(mla, alone)[0]
            torch.testing.assert_close(pre[b, :n], want[:n], rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(torch.cat([o[b] for o in dec]), want[n:], rtol=SINKED, atol=SINKED)
        mla.sinks.fill_(float("-inf"))  # without the sinks the same decode differs: they are applied
        plain = LatentCache.from_config(mla.config, B, 12, dtype=torch.float64, **kw)
        mla(padded, plain, input_lengths=torch.tensor(lengths))
        assert (mla(new[:, :1], plain) - dec[0]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["plain", "rms"])
def test_a_sparse_selection_with_sinks_on_every_path(name):
    """The indexer's selection (``indices``): the absorbed decode, the expand path and the direct softmax
    over the selected keys agree; a query whose selection is empty gives 0 (all on the sink)."""
    mla = sinked(VARIANTS[name])
    B, P, topk = 2, 9, 3
    x = torch.randn(B, P + 3, mla.config.hidden_size, dtype=torch.float64)
    prefill = random_selection(B, P, 0, topk, seed=1)
    steps = [random_selection(B, 1, P + i, topk, seed=2 + i) for i in range(3)]
    steps[1][1] = -1  # sequence 1 selects nothing at the second step
    outs = {}
    with torch.no_grad():
        for path in ("absorbed", "expand"):
            cache = LatentCache.from_config(mla.config, B, 16, dtype=torch.float64, fill=float("nan"))
            got = [mla(x[:, :P], cache, indices=prefill)]
            got += [mla(x[:, P + i:P + i + 1], cache, indices=s, path=path) for i, s in enumerate(steps)]
            outs[path] = torch.cat(got, dim=1)
        torch.testing.assert_close(outs["absorbed"], outs["expand"], rtol=SINKED, atol=SINKED)
        visible = torch.cat([selection_mask(s, P + 3) for s in [prefill] + steps], dim=1)  # [B, P + 3, P + 3]
        torch.testing.assert_close(outs["expand"], reference(mla, x, mask=visible), rtol=1e-10, atol=1e-12)
        assert outs["absorbed"][1, P + 1].eq(0).all() and outs["expand"][1, P + 1].eq(0).all()


def test_decode_one_token_applies_the_sinks():
    mla = sinked(VARIANTS["rms"])
    x = torch.randn(2, 8, mla.config.hidden_size, dtype=torch.float64)
    cache = LatentCache.from_config(mla.config, 2, 8, dtype=torch.float64, fill=float("nan"))
    with torch.no_grad():
        got = [mla(x[:, :5], cache)] + [decode_one_token(mla, x[:, t:t + 1], cache) for t in range(5, 8)]
        torch.testing.assert_close(torch.cat(got, dim=1), reference(mla, x), rtol=SINKED, atol=SINKED)


def test_float32_absorbed_decode_with_sinks_close_to_explicit():
    mla = sinked(VARIANTS["rms"], dtype=torch.float32)
    x = torch.randn(2, 14, mla.config.hidden_size)
    cache = LatentCache.from_config(mla.config, 2, 14)
    with torch.no_grad():
        got = torch.cat([mla(x[:, :8], cache)] + [mla(x[:, t:t + 1], cache) for t in range(8, 14)], 1)
        torch.testing.assert_close(got, mla(x), rtol=1e-4, atol=1e-5)


def test_gradients_reach_the_sinks_as_through_the_direct_softmax():
    mla = sinked(VARIANTS["rms"])
    x = torch.randn(2, 7, mla.config.hidden_size, dtype=torch.float64)
    weights = torch.randn(2, 7, mla.config.hidden_size, dtype=torch.float64)
    (mla(x) * weights).sum().backward()
    got = mla.sinks.grad.clone()
    mla.zero_grad()
    (reference(mla, x) * weights).sum().backward()
    assert got.abs().min() > 0
    torch.testing.assert_close(got, mla.sinks.grad, rtol=1e-10, atol=1e-12)
