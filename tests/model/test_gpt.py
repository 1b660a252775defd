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


@pytest.mark.parametrize("attn", ["mla-qknorm", "mla-lp", "mla", "gqa-qknorm", "mha", "v4"])
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
    for attn in ("mla-qknorm", "mla-lp", "mla"):  # refused whether or not the variant reads p
        with pytest.raises(ValueError, match=r"qk_norm_p: expected a finite number >= 1 and <= 100"):
            GPTConfig(attn=attn, qk_norm_p=0.5)
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


@pytest.mark.parametrize("attn", ["mha-lp", "mla-qknorm"])
def test_a_log_parameterized_logit_scale_trains_its_log(attn):
    """logit_scale_param="log": the stored parameter is log(scale), the attention reads the
    same scale (same logits at initialization), and an AdamW step moves the scale by a
    fraction of itself, where the linear parameter moves it by about lr in absolute terms."""
    cfg = GPTConfig(attn=attn, learnable_logit_scale=True, softmax_scale=20.0)
    torch.manual_seed(0)
    linear = GPT(cfg)
    torch.manual_seed(0)
    log = GPT(cfg.replace(logit_scale_param="log"))
    stored = dict(log.named_parameters())["blocks.0.attn.parametrizations.logit_scale.original"]
    assert torch.allclose(stored, torch.full_like(stored, 20.0).log())
    assert torch.allclose(log.blocks[0].attn.logit_scale, torch.full((4,), 20.0))
    x = torch.randint(0, 65, (2, 16))
    linear.eval(), log.eval()
    assert torch.allclose(linear(x)[0], log(x)[0], atol=1e-5)
    moved = {}
    for name, model in (("linear", linear), ("log", log)):
        opt = torch.optim.AdamW([p for n, p in model.named_parameters() if "logit_scale" in n], lr=0.1, weight_decay=0.0, eps=1e-30)
        model(x, x)[1].backward()
        opt.step()
        moved[name] = model.blocks[0].attn.logit_scale.detach()
    assert torch.allclose((moved["linear"] - 20.0).abs(), torch.full((4,), 0.1), rtol=1e-3)  # Adam's first step: lr
    assert torch.allclose((moved["log"] / 20.0).log().abs(), torch.full((4,), 0.1), rtol=1e-3)  # a factor e^(+-0.1)
    state = log.state_dict()  # saved and loaded as the log
    again = GPT(cfg.replace(logit_scale_param="log"))
    again.load_state_dict(state)
    assert torch.equal(again.blocks[0].attn.logit_scale, log.blocks[0].attn.logit_scale)


def test_logit_scale_param_is_checked():
    with pytest.raises(ValueError, match="logit_scale_param: expected one of"):
        GPTConfig(attn="mha-lp", logit_scale_param="sqrt")
    with pytest.raises(ValueError, match="logit_scale_param: 'log' needs a learned logit scale"):
        GPTConfig(attn="mla-qknorm", logit_scale_param="log")


def test_v4_caches_what_plain_mla_caches_by_default():
    """v4's default shared vector is d_c + d_r wide: plain MLA's cache row at the same shape."""
    cfg = GPT_PRESETS["cpu"].replace(n_head=3, n_embd=192)
    v4, mla = GPT(cfg.replace(attn="v4")), GPT(cfg.replace(attn="mla"))
    a = v4.blocks[0].attn.config
    assert (a.head_dim, a.rope_head_dim, a.q_lora_rank, a.attention_sinks) == (148, 20, None, True)
    assert v4.make_caches(1, 4)[0].bytes_per_token == mla.make_caches(1, 4)[0].bytes_per_token == 148 * 4
    assert GPT(cfg.replace(attn="v4", shared_kv_dim=64, attention_sinks=False)).blocks[0].attn.sinks is None


def test_init_seed_draws_each_tensor_by_name():
    """With init_seed, tensors of the same name and shape are equal across variants whose attention
    differs (without it the attention's draws shift every later tensor), and another seed differs."""
    cfg = GPT_PRESETS["debug"].replace(init_seed=7)
    a, b = GPT(cfg.replace(attn="v4")), GPT(cfg.replace(attn="mla"))
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    shared = [k for k in pa if k in pb and pa[k].shape == pb[k].shape]
    assert "blocks.1.mlp.up.weight" in shared and "wte.weight" in shared
    assert all(torch.equal(pa[k], pb[k]) for k in shared)
    torch.manual_seed(0)
    plain_a = dict(GPT(cfg.replace(attn="v4", init_seed=None)).named_parameters())
    torch.manual_seed(0)
    plain_b = dict(GPT(cfg.replace(attn="mla", init_seed=None)).named_parameters())
    assert not torch.equal(plain_a["blocks.1.mlp.up.weight"], plain_b["blocks.1.mlp.up.weight"])
    other = dict(GPT(cfg.replace(attn="v4", init_seed=8)).named_parameters())
    assert not torch.equal(other["wte.weight"], pa["wte.weight"])
    residual = pa["blocks.0.mlp.down.weight"].std() / pa["blocks.0.mlp.up.weight"].std()
    assert 0.3 < float(residual) < 0.7  # GPT-2's 1 / sqrt(2 n_layer) = 0.5 kept for residual projections
    assert torch.equal(pa["blocks.0.attn.sinks"], torch.zeros(4))


def test_v4_options_are_checked():
    with pytest.raises(ValueError, match="shared_kv_dim: only the v4 variant"):
        GPTConfig(attn="mla", shared_kv_dim=64)
    with pytest.raises(ValueError, match="attention_sinks: only the v4 variant"):
        GPTConfig(attn="mha", attention_sinks=True)
    with pytest.raises(ValueError, match="learnable_logit_scale: the v4 variant"):
        GPTConfig(attn="v4", learnable_logit_scale=True)
    with pytest.raises(ValueError, match="init_seed"):
        GPTConfig(init_seed=-1)
    with pytest.raises(ValueError, match="policy"):
        GPT(GPTConfig(attn="v4")).make_caches(1, 4, policy=object())
