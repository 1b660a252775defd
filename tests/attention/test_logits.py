"""The Appendix E logits, both ways: explicit from materialized keys, absorbed from latent rows."""

import pytest
import torch

from qkmla import MLA, MLAConfig, QKNormConfig
from qkmla.attention.logits import causal_logits
from qkmla.cli.verify import perturb_vectors

VARIANTS = {
    "rms": dict(qk_norm="rms"),
    "rms-unified": dict(qk_norm=QKNormConfig("rms", mode="unified")),
    "l2-learnable-scale": dict(qk_norm=QKNormConfig("l2", learnable_logit_scale=True), softmax_scale=5.0),
    "gqa": dict(qk_norm="rms", num_kv_groups=2),
    "plain": dict(qk_norm=None),
}


def make(**kw) -> MLA:
    torch.manual_seed(0)
    mla = perturb_vectors(MLA(MLAConfig(**kw))).double()
    if mla.logit_scale is not None:  # one scale per head, all different
        with torch.no_grad():
            mla.logit_scale.mul_(torch.linspace(0.5, 1.5, mla.config.num_heads, dtype=torch.float64))
    return mla


@pytest.mark.parametrize("name", list(VARIANTS))
def test_explicit_logits_are_the_scaled_dot_products_of_the_materialized_keys(name):
    mla = make(**VARIANTS[name])
    B, T, h = 2, 7, mla.config.num_heads
    x = torch.randn(B, T, mla.config.hidden_size, dtype=torch.float64)
    positions = torch.arange(3, 3 + T)
    s = causal_logits(mla, x, "explicit", positions)
    assert s.shape == (B, h, T, T)
    q, k, _ = mla.explicit_qkv(x, positions.expand(B, T))
    k = k.repeat_interleave(h // mla.config.num_kv_groups, dim=2)
    scale = mla.scale.view(h, 1, 1) if isinstance(mla.scale, torch.Tensor) else mla.scale
    want = torch.einsum("bthd,bshd->bhts", q, k) * scale
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    torch.testing.assert_close(s[..., causal], want[..., causal], rtol=0, atol=1e-12)
    assert bool(torch.isneginf(s[..., ~causal]).all())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_absorbed_logits_equal_explicit_to_roundoff(name):
    mla = make(**VARIANTS[name])
    x = torch.randn(2, 9, mla.config.hidden_size, dtype=torch.float64)
    explicit, absorbed = causal_logits(mla, x, "explicit"), causal_logits(mla, x, "absorbed")
    finite = torch.isfinite(explicit)
    assert bool((finite == torch.isfinite(absorbed)).all())
    size = explicit[finite].abs().max()
    assert size > 1.0  # logits of a useful size, so the bound below is not vacuous
    assert (explicit[finite] - absorbed[finite]).abs().max() <= 1e-10 * size
    assert torch.equal(mla.logits(x, "absorbed"), absorbed)  # the module's method is this function


def test_an_unknown_path_is_refused_before_any_work(monkeypatch):
    mla = make(qk_norm="rms")
    monkeypatch.setattr(mla, "explicit_qkv", lambda *a, **k: pytest.fail("projected before checking path"))
    with pytest.raises(ValueError, match=r"path: expected one of \('explicit', 'absorbed'\), got 'expand'"):
        causal_logits(mla, torch.randn(1, 3, mla.config.hidden_size, dtype=torch.float64), "expand")
    with pytest.raises(ValueError, match="x: expected shape"):
        causal_logits(mla, torch.randn(1, 3, mla.config.hidden_size + 1, dtype=torch.float64))
