import math

import pytest
import torch

from qkmla import AttentionConfig, MLA, MLAConfig, MultiHeadAttention, QKNormConfig
from qkmla.attention.functional import max_logits
from qkmla.train.diagnostics import logit_bound, logit_scale


def test_unit_weights_cap_an_rms_head_at_sqrt_of_its_width():
    """The temperature cap of the paper's default: blockwise RMS, unit weights, tau = (d_n + d_r)^-1/2."""
    cfg = MLAConfig(qk_nope_head_dim=16, qk_rope_head_dim=8)
    assert logit_bound(MLA(cfg)) == pytest.approx(math.sqrt(24))
    assert logit_bound(MLA(cfg.replace(qk_norm=QKNormConfig("rms", mode="unified")))) == pytest.approx(math.sqrt(24))
    assert logit_bound(MLA(cfg.replace(qk_norm="l2"))) == pytest.approx(2 / math.sqrt(24))
    assert logit_bound(MLA(cfg.replace(qk_norm=QKNormConfig("lp", p=4.0)))) == pytest.approx(
        (16 ** 0.5 + 8 ** 0.5) / math.sqrt(24))
    assert logit_bound(MLA(cfg.replace(qk_norm=None))) is None
    assert logit_bound(MultiHeadAttention(AttentionConfig(head_dim=16, qk_norm="rms"))) == pytest.approx(4.0)


def test_bound_follows_the_weights_and_the_learned_scale():
    mla = MLA(MLAConfig(qk_nope_head_dim=16, qk_rope_head_dim=8, qk_norm=QKNormConfig(learnable_logit_scale=True)))
    base = logit_bound(mla)
    with torch.no_grad():
        mla.q_norm.content.weight.fill_(2.0)
        mla.k_norm.content.weight[3] = 3.0  # the largest product decides: 2 x 3
        mla.logit_scale[1] *= 2
    assert logit_bound(mla) == pytest.approx(2 * base * (16 * 6 + 8) / 24)
    assert logit_scale(mla) == pytest.approx(mla.config.scale * 5 / 4)


@pytest.mark.parametrize("kind,mode,p", [("rms", "blockwise", 2.0), ("rms", "unified", 2.0), ("l2", "blockwise", 2.0),
                                         ("lp", "blockwise", 4.0), ("lp", "unified", 1.5)])
def test_bound_holds_and_is_nearly_reached(kind, mode, p):
    """Random weights: measured logits stay under the bound. Keys equal to queries with
    flat content and RoPE blocks reach it (up to eps)."""
    torch.manual_seed(0)
    cfg = MLAConfig(qk_nope_head_dim=16, qk_rope_head_dim=8, qk_norm=QKNormConfig(kind, mode=mode, p=p, eps=0.0))
    mla = MLA(cfg).double()
    with torch.no_grad():
        for norm in (mla.q_norm, mla.k_norm):
            for w in (norm.content.weight, norm.rope.weight):
                w.uniform_(0.5, 2.0)
    x = torch.randn(2, 12, cfg.hidden_size, dtype=torch.float64) * 3
    q, k, _ = mla.explicit_qkv(x, torch.arange(12).expand(2, 12))
    assert float(max_logits(q, k, mla.scale).max()) <= logit_bound(mla) * (1 + 1e-9)
    # The bound's own extreme, q = k with constant norm weights: flat vectors for p >= 2,
    # one-hot for p < 2 (unified: one nonzero in the whole vector).
    qn, kn = mla.q_norm, mla.k_norm
    flat_c, flat_r = torch.ones(1, 1, 1, 16, dtype=torch.float64), torch.ones(1, 1, 1, 8, dtype=torch.float64)
    if p < 2:
        flat_c, flat_r = torch.zeros_like(flat_c), torch.zeros_like(flat_r)
        flat_c[..., 0] = 1.0
        if mode == "blockwise":
            flat_r[..., 0] = 1.0
    with torch.no_grad():
        for norm in (qn, kn):
            norm.content.weight.fill_(1.5)
            norm.rope.weight.fill_(1.5)
        qc, qr = qn(flat_c, flat_r)
        kc, kr = kn(flat_c, flat_r)
    reached = float((qc * kc).sum() + (qr * kr).sum()) * mla.scale
    assert reached == pytest.approx(logit_bound(mla), rel=1e-9)


def test_forward_max_logits_restores_mode_and_tracking():
    import torch

    from qkmla.attention.functional import max_logits
    from qkmla.model.gpt import GPT, GPT_PRESETS
    from qkmla.train.diagnostics import forward_max_logits

    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(attn="mla", dropout=0.1)).train()
    x = torch.randint(0, 65, (2, 12))
    got = forward_max_logits(model, x)
    assert got.shape == (2, 4) and model.training
    assert not any(b.attn.track_max_logits for b in model.blocks)
    # layer 0's logits by hand: the same queries and keys the module makes from its input
    attn = model.blocks[0].attn
    h = model.blocks[0].ln_1(model.wte(x))
    q, k, _ = attn.explicit_qkv(h, torch.arange(12).expand(2, -1))
    torch.testing.assert_close(got[0], max_logits(q, k, attn.scale).float())


def test_a_statistic_over_the_projection_lets_one_head_hold_it_all_and_the_bound_says_so():
    """qk_norm_scope='projection', RMS, h = 4 heads, G = 2 groups: a query whose whole length is in
    head 0 and a key whose content is all in group 0 reach d_n sqrt(h G) gain + d_r sqrt(h) gain, the
    bound; random inputs stay under it. Content mode has no bound (its RoPE block is not normalized)."""
    torch.manual_seed(0)
    cfg = MLAConfig(qk_nope_head_dim=16, qk_rope_head_dim=8, num_heads=4, num_kv_groups=2,
                    qk_norm=QKNormConfig("rms", eps=0.0, scope="projection"))
    mla = MLA(cfg).double()
    with torch.no_grad():
        for w in (mla.q_norm.content.weight, mla.q_norm.rope.weight, mla.k_norm.content.weight, mla.k_norm.rope.weight):
            w.fill_(1.5)
    bound = logit_bound(mla)
    assert bound == pytest.approx(mla.scale * 2.25 * (16 * (4 * 2) ** 0.5 + 8 * 4 ** 0.5))
    q_c, q_r = torch.zeros(1, 1, 4, 16, dtype=torch.float64), torch.zeros(1, 1, 4, 8, dtype=torch.float64)
    q_c[..., 0, :], q_r[..., 0, :] = 1.0, 1.0
    k_c, k_r = torch.zeros(1, 1, 2, 16, dtype=torch.float64), torch.ones(1, 1, 1, 8, dtype=torch.float64)
    k_c[..., 0, :] = 1.0
    with torch.no_grad():
        qc, qr = mla.q_norm(q_c, q_r)
        kc, kr = mla.k_norm(k_c, k_r)
    reached = float((qc[0, 0, 0] * kc[0, 0, 0]).sum() + (qr[0, 0, 0] * kr[0, 0, 0]).sum()) * mla.scale
    assert reached == pytest.approx(bound, rel=1e-9)
    x = torch.randn(2, 12, cfg.hidden_size, dtype=torch.float64) * 3
    q, k, _ = mla.explicit_qkv(x, torch.arange(12).expand(2, 12))
    assert float(max_logits(q, k, mla.scale).max()) <= bound * (1 + 1e-9)
    assert logit_bound(MLA(cfg.replace(qk_norm=QKNormConfig("rms", mode="content")))) is None


def test_the_shared_kv_bound_holds_and_unit_gains_give_sqrt_of_the_width():
    """v4: an unweighted unit-RMS query against a weighted RMSNorm key: tau D max|w|, sqrt(D) at unit gains."""
    from qkmla.attention.shared_kv import SharedKVAttention
    from qkmla.config import SharedKVConfig

    torch.manual_seed(0)
    attn = SharedKVAttention(SharedKVConfig(hidden_size=32, num_heads=2, head_dim=16, rope_head_dim=4, q_lora_rank=8))
    assert logit_bound(attn) == pytest.approx(math.sqrt(16))
    with torch.no_grad():
        attn.kv_norm.weight.mul_(3.0)
    assert logit_bound(attn) == pytest.approx(3 * math.sqrt(16))
    attn.track_max_logits = True
    attn(torch.randn(4, 12, 32))
    assert float(attn.last_max_logits.max()) <= logit_bound(attn)
