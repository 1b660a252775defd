import pytest
import torch

from qkmla.model.gpt import ATTENTION_VARIANTS, GPT, GPT_PRESETS, GPTConfig


@pytest.mark.parametrize("attn", ATTENTION_VARIANTS)
def test_every_variant_trains_a_step(attn):
    model = GPT(GPT_PRESETS["debug"].replace(attn=attn))
    idx = torch.randint(0, 65, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 65) and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("attn", ["mla-qknorm", "mla-lp", "mla", "gqa-qknorm", "mha"])
def test_logits_with_cache_equal_logits_without(attn):
    model = GPT(GPT_PRESETS["debug"].replace(attn=attn)).double().eval()
    idx = torch.randint(0, 65, (2, 20))
    full, _ = model(idx)
    caches = model.make_caches(2, 20, dtype=torch.float64)
    pieces = [model(idx[:, :8], caches=caches)[0]] + [model(idx[:, t:t + 1], caches=caches)[0] for t in range(8, 20)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-9, atol=1e-9)


def test_paper_400m_builds_and_steps():
    model = GPT(GPT_PRESETS["paper-400m"].replace(attn="mla-qknorm", block_size=32))
    assert 300e6 < model.num_params() < 600e6
    idx = torch.randint(0, 50304, (1, 32))
    _, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)


def test_bad_config_and_input():
    with pytest.raises(ValueError, match="attn"):
        GPTConfig(attn="linear")
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=64, n_head=5)
    model = GPT(GPT_PRESETS["debug"])
    with pytest.raises(ValueError, match="idx"):
        model(torch.randn(2, 4))
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 100, dtype=torch.long))


def test_logit_scale_options():
    """RMS QK-norm variants can learn a per-head logit scale (the temperature-cap remedy);
    softmax_scale sets tau (its initial value when learned)."""
    from qkmla.model.gpt import GPT, GPTConfig

    plain = GPT(GPTConfig(attn="mla-qknorm")).blocks[0].attn
    assert plain.logit_scale is None
    learned = GPT(GPTConfig(attn="mla-qknorm", learnable_logit_scale=True, softmax_scale=0.5)).blocks[0].attn
    assert learned.logit_scale.shape == (4,) and bool((learned.logit_scale == 0.5).all())
    mha = GPT(GPTConfig(attn="mha-lp", learnable_logit_scale=False, softmax_scale=2.0)).blocks[0].attn
    assert mha.logit_scale is None and mha.scale == 2.0
