"""The norm statistic's moments: no overflow past the dtype's range, the plain sum bit for bit inside it."""

import pytest
import torch

from qkmla.norms import QKNorm, ScalarNorm
from qkmla.ops.statistic import moment, statistic

# (kind, p, the largest |v| whose plain float32 moment overflows)
OVERFLOWING = [("rms", 2.0, 3e19), ("l2", 2.0, 1e38), ("lp", 2.0, 2e19), ("lp", 3.0, 1e13), ("lp", 16.0, 300.0)]


def plain_statistic(v, kind, p, eps):
    """The formula as written in MATH.md, in v's own dtype (the statistic before moments were scaled)."""
    m = torch.linalg.vecdot(v, v).unsqueeze(-1) if kind != "lp" or p == 2 else v.abs().pow(p).sum(-1, keepdim=True)
    if kind == "rms":
        return (m / v.shape[-1] + eps).rsqrt()
    return (m + eps).rsqrt() if kind == "l2" or p == 2 else (m + eps).pow(-1.0 / p)


@pytest.mark.parametrize("kind,p,big", OVERFLOWING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_moment_past_the_range_gives_the_float64_answer(kind, p, big, dtype):
    v = torch.tensor([[big, 1.0, -2.0, 3.0], [0.5, -big / 7, big / 3, 0.0]]).to(dtype)
    assert not torch.isfinite(plain_statistic(v.float(), kind, p, 1e-6) ** -1).all()  # the plain sum overflows
    norm = ScalarNorm(4, kind, p=p).to(dtype)
    got, want = norm(v.requires_grad_()), ScalarNorm(4, kind, p=p).double()(v.double())
    assert got.abs().amax() > 0.1  # a vector normalized to zeros was the failure
    torch.testing.assert_close(got.double(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-30)
    got.square().sum().backward()
    assert torch.isfinite(v.grad).all()


@pytest.mark.parametrize("kind,p,big", OVERFLOWING)
def test_the_gradient_past_the_range_is_the_float64_gradient(kind, p, big):
    x = torch.tensor([[big, 1.0, -2.0, 3.0]], dtype=torch.float64)
    for dtype in (torch.float32, torch.float64):
        v = x.to(dtype).requires_grad_()
        (ScalarNorm(4, kind, p=p).to(dtype)(v) * torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=dtype)).sum().backward()
        if dtype == torch.float32:
            got = v.grad.double()
        else:
            want = v.grad
    # the big entry's own gradient cancels to ~0: roundoff is judged against the gradient's scale
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().amax()))


def test_a_float64_moment_past_float64s_range():
    v = torch.tensor([[1e300, 2.0, 3.0]], dtype=torch.float64)
    got = ScalarNorm(3, "lp", p=3.0).double()(v)
    torch.testing.assert_close(got, v / 1e300, rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", ["unified", "content", "blockwise"])
@pytest.mark.parametrize("scope", ["head", "projection"])
def test_blocks_and_heads_past_the_range_pool_with_the_others(mode, scope):
    """Unified and projection pool moments of different scales: one head's content overflows, the rest do not."""
    g = torch.Generator().manual_seed(0)
    v_c, v_r = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 4, generator=g)
    v_c[1, 2, 0] = 4e19
    norm = QKNorm(8, 4, kind="lp", p=4.0, mode=mode, scope=scope)
    got = norm(v_c, v_r)
    want = norm.double()(v_c.double(), v_r.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-30)
    assert got[0].abs().amax() > 0.5


@pytest.mark.parametrize("kind,p", [("rms", 2.0), ("l2", 2.0), ("lp", 2.0), ("lp", 3.0), ("lp", 16.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_inside_the_range_values_and_gradients_are_the_plain_formulas_bit_for_bit(kind, p, dtype):
    """Training runs committed before the scaling continue on the same trajectory: nothing changes in range."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 4, 24, generator=g) * 3).to(dtype)
    weight = torch.rand(24, generator=g).to(dtype) + 0.5
    outs = []
    for sigma in (lambda v: statistic(v, kind, p, 1e-6), lambda v: plain_statistic(v, kind, p, 1e-6)):
        v = x.clone().requires_grad_()
        y = v * sigma(v) * weight
        (y.square().sum() + y.sum()).backward()
        outs.append((y.detach(), v.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_zero_and_tiny_vectors_are_eps_bound():
    v = torch.tensor([[0.0, 0.0], [1e-30, 0.0]])
    for kind, p in (("rms", 2.0), ("lp", 16.0)):
        torch.testing.assert_close(statistic(v, kind, p, 1e-6), plain_statistic(v.double(), kind, p, 1e-6).float())
    assert (moment(v, "lp", 16.0).shift == 0).all()


@pytest.mark.parametrize("kind,p", [("rms", 2.0), ("l2", 2.0), ("lp", 3.0), ("lp", 16.0)])
def test_with_eps_zero_a_tiny_vector_is_normalized_not_inf(kind, p):
    """With eps = 0 the moment is the whole denominator: 1e-30s squared underflow in float32 (they gave inf)."""
    v = torch.tensor([[1e-30, 2e-30, -2e-30], [3e-20, 0.0, 1e-20]])
    got = ScalarNorm(3, kind, p=p, eps=0.0)(v)
    torch.testing.assert_close(got.double(), ScalarNorm(3, kind, p=p, eps=0.0).double()(v.double()), rtol=1e-6, atol=0)
    with_eps = ScalarNorm(3, kind, p=p)(v)  # eps > 0 bounds sigma: eps-dominated, and no rescaling
    torch.testing.assert_close(with_eps, v * 1e-6 ** (-1 / p if kind == "lp" else -0.5), rtol=1e-5, atol=0)
