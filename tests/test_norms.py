import pytest
import torch

from qkmla.norms import QKNorm, ScalarNorm
from qkmla.ops.statistic import statistic


def test_rms_matches_torch_rmsnorm():
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    ours = ScalarNorm(16, "rms", eps=1e-6).double()
    ref = torch.nn.RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-12, atol=1e-12)


def test_l2_is_henry_qknorm_and_lp2():
    x = torch.randn(4, 10, dtype=torch.float64)
    l2 = ScalarNorm(10, "l2", eps=0.0).double()
    torch.testing.assert_close(l2(x), torch.nn.functional.normalize(x, dim=-1), rtol=1e-12, atol=1e-12)
    lp2 = ScalarNorm(10, "lp", p=2.0, eps=0.0).double()
    torch.testing.assert_close(lp2(x), l2(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("p", [1.0, 1.5, 3.0, 4.0])
def test_lp_has_unit_p_norm(p):
    x = torch.randn(6, 12, dtype=torch.float64)
    y = ScalarNorm(12, "lp", p=p, eps=0.0).double()(x)
    torch.testing.assert_close(torch.linalg.vector_norm(y, ord=p, dim=-1), torch.ones(6, dtype=torch.float64))


def test_statistic_is_scale_inverse():
    """sigma(a v) = sigma(v) / a for every member (eps = 0): what makes the logit scale-free."""
    v = torch.randn(8, 9, dtype=torch.float64)
    for kind, p in [("rms", 2), ("l2", 2), ("lp", 3.0), ("lp", 1.0)]:
        torch.testing.assert_close(statistic(5 * v, kind, p, 0.0), statistic(v, kind, p, 0.0) / 5)


def test_unified_is_one_statistic_over_concatenation():
    q_c, q_r = torch.randn(2, 3, 16, dtype=torch.float64), torch.randn(2, 3, 8, dtype=torch.float64)
    norm = QKNorm(16, 8, "rms", mode="unified").double()
    with torch.no_grad():
        norm.content.weight.uniform_(0.5, 1.5)
        norm.rope.weight.uniform_(0.5, 1.5)
    ref = torch.nn.RMSNorm(24, eps=1e-6).double()
    with torch.no_grad():
        ref.weight.copy_(torch.cat((norm.content.weight, norm.rope.weight)))
    got = torch.cat(norm(q_c, q_r), dim=-1)
    torch.testing.assert_close(got, ref(torch.cat((q_c, q_r), dim=-1)), rtol=1e-12, atol=1e-12)


def test_unified_broadcasts_shared_rope_key_per_group():
    k_c, k_r = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 1, 8)
    sigma_c, sigma_r = QKNorm(16, 8, "rms", mode="unified").statistics(k_c, k_r)
    assert sigma_c.shape == (2, 5, 4, 1) and sigma_r is sigma_c


def test_content_mode_takes_the_statistic_from_the_content_block_alone():
    """Content mode: a head whose content block holds a whole vector v (a converted GQA head,
    RoPE dims included) is normalized as RMSNorm(v) would, and the RoPE block is scaled by the
    same statistic; the RoPE block's values do not enter it."""
    v, k_r = torch.randn(2, 3, 4, 16, dtype=torch.float64), torch.randn(2, 3, 1, 8, dtype=torch.float64)
    norm = QKNorm(16, 8, "rms", mode="content").double()
    with torch.no_grad():
        norm.content.weight.uniform_(0.5, 1.5)
        norm.rope.weight.uniform_(0.5, 1.5)
    got_c, got_r = norm(v, k_r)
    torch.testing.assert_close(got_c, torch.nn.functional.rms_norm(v, (16,), norm.content.weight, eps=1e-6))
    sigma = (v.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    torch.testing.assert_close(got_r, norm.rope.weight * k_r * sigma)
    assert torch.equal(norm(v, 100 * k_r)[0], got_c)


def test_bf16_statistic_is_computed_in_float32():
    x = torch.randn(4, 64).to(torch.bfloat16) * 300
    assert statistic(x, "rms").dtype == torch.float32
    assert ScalarNorm(64)(x).dtype == torch.bfloat16


def test_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        ScalarNorm(4, "batch")
    with pytest.raises(ValueError, match="mode: expected one of"):
        QKNorm(4, 2, mode="joint")


def test_the_state_dict_records_the_variant():
    """Issue 27, class 3: RMS and L2, blockwise and unified have the same shapes; the record
    tells them apart."""
    state = QKNorm(8, 4, "rms").state_dict()
    assert bytes(state["_extra_state"].tolist()).decode() == "rms blockwise"
    assert bytes(QKNorm(8, 4, "lp", p=3.0, mode="unified").state_dict()["_extra_state"].tolist()).decode() == \
        "lp(p=3) unified"
    with pytest.raises(ValueError, match="belong to a rms blockwise QK norm, but this module's is rms unified"):
        QKNorm(8, 4, "rms", mode="unified").load_state_dict(state)


def test_the_statistic_of_a_built_norm_cannot_be_reassigned():
    """Issue 27, class 3: the kind, p, eps and mode are the norm's function, read-only."""
    q = QKNorm(8, 4, "lp", p=3.0)
    for obj, name, value in ((q, "mode", "unified"), (q.content, "kind", "rms"), (q.content, "p", 2.0),
                             (q.rope, "eps", 0.1)):
        with pytest.raises(AttributeError):
            setattr(obj, name, value)
    assert (q.mode, q.content.kind, q.content.p, q.rope.eps) == ("blockwise", "lp", 3.0, 1e-6)


@pytest.mark.parametrize("mode", ["blockwise", "unified", "content"])
def test_projection_scope_is_one_rmsnorm_over_the_whole_projection(mode):
    """With the projection scope a token's heads share one statistic and each channel has its own
    weight: exactly torch's RMSNorm over the flattened [H d] projection (OLMoE's q_norm), per block
    in blockwise mode, over [content; rope] of every head in unified mode, from the content blocks
    in content mode."""
    H, d_c, d_r = 4, 16, 8
    q_c, q_r = torch.randn(2, 3, H, d_c, dtype=torch.float64), torch.randn(2, 3, H, d_r, dtype=torch.float64)
    norm = QKNorm(d_c, d_r, "rms", mode=mode, scope="projection", heads=H, rope_heads=H).double()
    assert norm.content.weight.shape == (H, d_c) and norm.rope.weight.shape == (H, d_r)
    with torch.no_grad():
        norm.content.weight.uniform_(0.5, 1.5)
        norm.rope.weight.uniform_(0.5, 1.5)
    got_c, got_r = norm(q_c, q_r)

    def rmsnorm(v, weight):
        ref = torch.nn.RMSNorm(v.shape[-2] * v.shape[-1], eps=1e-6).double()
        with torch.no_grad():
            ref.weight.copy_(weight.flatten())
        return ref(v.flatten(-2)).view(v.shape)

    if mode == "blockwise":
        want_c, want_r = rmsnorm(q_c, norm.content.weight), rmsnorm(q_r, norm.rope.weight)
    elif mode == "unified":
        both = rmsnorm(torch.cat((q_c, q_r), -1), torch.cat((norm.content.weight, norm.rope.weight), -1))
        want_c, want_r = both.split([d_c, d_r], dim=-1)
    else:
        sigma = (q_c.square().mean(dim=(-2, -1), keepdim=True) + 1e-6).rsqrt()
        want_c, want_r = q_c * sigma * norm.content.weight, q_r * sigma * norm.rope.weight
    torch.testing.assert_close(got_c, want_c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_r, want_r, rtol=1e-12, atol=1e-12)


def test_projection_scope_counts_a_shared_rope_key_once_per_group():
    """A key's RoPE block [.., 1, d_r] is shared by its G groups: the pooled statistic is the one
    of the materialized keys [k_c^g; k_r] of every group, one scalar per token."""
    G, d_c, d_r = 3, 16, 8
    k_c, k_r = torch.randn(2, 5, G, d_c, dtype=torch.float64), torch.randn(2, 5, 1, d_r, dtype=torch.float64)
    norm = QKNorm(d_c, d_r, "l2", mode="unified", scope="projection", heads=G).double()
    sigma, _ = norm.statistics(k_c, k_r)
    whole = torch.cat((k_c, k_r.expand(2, 5, G, d_r)), dim=-1).flatten(-2)
    assert sigma.shape == (2, 5, 1, 1)
    torch.testing.assert_close(sigma[..., 0, 0], (whole.square().sum(-1) + 1e-6).rsqrt(), rtol=1e-12, atol=0)


def test_scope_is_checked_and_recorded():
    with pytest.raises(ValueError, match="scope: expected one of"):
        QKNorm(8, 4, scope="model")
    assert QKNorm(8, 4, scope="projection", heads=2).variant() == "rms blockwise over the projection"
    assert QKNorm(8, 4).variant() == "rms blockwise"
