import pytest
import torch

from qkmla import MLA, AttentionConfig, MLAConfig, MultiHeadAttention
from qkmla.attention.functional import max_logits
from qkmla.attention.qk_clip import qk_clip_

MODULES = {
    "mla": lambda: MLA(MLAConfig(qk_norm=None)),
    "mla-no-q-lora-G2": lambda: MLA(MLAConfig(qk_norm=None, q_lora_rank=None, num_kv_groups=2)),
    "mha": lambda: MultiHeadAttention(AttentionConfig(hidden_size=64, num_heads=4, num_kv_heads=4)),
    "gqa": lambda: MultiHeadAttention(AttentionConfig(hidden_size=64, num_heads=4, num_kv_heads=2)),
}


def logits(module, x):
    pos = torch.arange(x.shape[1]).expand(x.shape[0], -1)
    if isinstance(module, MLA):
        q, k, _ = module.explicit_qkv(x, pos)
    else:
        q, k, _ = module.qkv(x, pos)
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * module.config.scale
    return s.masked_fill(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1), float("-inf"))


def test_max_logits_matches_full_matrix_in_chunks():
    mla = MLA(MLAConfig(qk_norm=None)).double()
    x = torch.randn(2, 37, 64, dtype=torch.float64)
    q, k, _ = mla.explicit_qkv(x, torch.arange(37).expand(2, -1))
    full = logits(mla, x).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_logits(q, k, mla.config.scale, chunk=8), full)


@pytest.mark.parametrize("name", list(MODULES))
def test_clipped_logits_are_exactly_gamma_times_old(name):
    torch.manual_seed(0)
    module = MODULES[name]().double()
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 2:
                p.mul_(6.0)  # large weights: large logits
    x = torch.randn(2, 16, 64, dtype=torch.float64)
    with torch.no_grad():
        before = logits(module, x)
    head_max = before.amax(dim=(0, 2, 3))
    tau = float(head_max.median())  # about half the heads are clipped
    gamma = qk_clip_(module, head_max, tau=tau)
    assert (gamma < 1).any() and (gamma == 1).any()
    with torch.no_grad():
        after = logits(module, x)
    finite = torch.isfinite(before)
    expected = before * gamma[None, :, None, None]
    torch.testing.assert_close(after[finite], expected[finite], rtol=1e-12, atol=1e-12)
    assert float(after.amax(dim=(0, 2, 3)).max()) == pytest.approx(tau, rel=1e-12)


def test_mla_rule_splits_content_and_rope():
    """Content query/key rows get sqrt(gamma), the RoPE query gamma, the shared RoPE key nothing."""
    mla = MLA(MLAConfig(qk_norm=None)).double()
    c = mla.config
    w_q = mla.q_b_proj.weight.detach().clone().view(c.num_heads, c.qk_head_dim, -1)
    w_kv = mla.kv_b_proj.weight.detach().clone()
    w_kr = mla.kv_a_proj_with_mqa.weight.detach().clone()
    gamma = qk_clip_(mla, torch.tensor([400.0, 50.0, 200.0, 100.0]), tau=100.0)
    torch.testing.assert_close(gamma, torch.tensor([0.25, 1.0, 0.5, 1.0]))
    new_q = mla.q_b_proj.weight.view(c.num_heads, c.qk_head_dim, -1)
    torch.testing.assert_close(new_q[0, :c.qk_nope_head_dim], w_q[0, :c.qk_nope_head_dim] * 0.5)
    torch.testing.assert_close(new_q[0, c.qk_nope_head_dim:], w_q[0, c.qk_nope_head_dim:] * 0.25)
    torch.testing.assert_close(new_q[1], w_q[1])
    key_rows = mla.kv_b_proj.weight.view(c.num_kv_groups, -1, c.kv_lora_rank)[:, :c.qk_nope_head_dim]
    torch.testing.assert_close(key_rows[0], w_kv.view(c.num_kv_groups, -1, c.kv_lora_rank)[0, :c.qk_nope_head_dim] * 0.5)
    torch.testing.assert_close(mla.kv_a_proj_with_mqa.weight, w_kr)


def test_refuses_qk_normed_layers_and_bad_args():
    with pytest.raises(ValueError, match="QK-Clip is for layers without QK norm"):
        qk_clip_(MLA(MLAConfig(qk_norm="rms")), torch.ones(4), 1.0)
    with pytest.raises(ValueError, match="max_logit"):
        qk_clip_(MLA(MLAConfig(qk_norm=None)), torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="tau"):
        qk_clip_(MLA(MLAConfig(qk_norm=None)), torch.ones(4), 0.0)
