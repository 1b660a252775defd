"""The CPU kernel for x W^T over a few rows (``ops/small_linear.cpp``) against float64 and ``F.linear``.

The kernel sums each output's K products in float32 and rounds it to bfloat16 once, so every
output is within half a bfloat16 step of the float64 product, plus float32 summation error.
Skipped where the kernel cannot run (no AVX-512 BF16, no compiler), with the reason.
"""

import dataclasses

import pytest
import torch

from qkmla.ops import small_linear as sl
from qkmla.ops.cpu_extension import build

REASON = build()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))


def operands(T, N, K, lead=(), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, T, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    return x, w


def check_rounded_once(y, x, w):
    """Each output within half a bf16 step of the float64 product, plus float32 summation error."""
    ref = x.double() @ w.double().T
    slack = ref.abs() * 2.0 ** -8 + x.shape[-1] * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    assert ((y.double() - ref).abs() <= slack).all(), (y.double() - ref).abs().max()


@pytest.mark.parametrize("T", [1, 3, 4, 5, 9, 33])
@pytest.mark.parametrize("N,K", [(512, 512), (100, 96), (1, 2), (64, 34), (130, 512)])
def test_the_kernel_rounds_the_float64_product_once(T, N, K):
    x, w = operands(T, N, K)
    packed = sl.pack_weight(w)
    assert packed is not None and torch.equal(packed.unpack(), w)
    check_rounded_once(sl.small_linear(x, packed), x, w)


def test_leading_dimensions_and_strided_rows_are_taken():
    x, w = operands(5, 96, 64, lead=(2, 3))
    y = sl.small_linear(x, sl.pack_weight(w))
    assert y.shape == (2, 3, 5, 96)
    check_rounded_once(y, x, w)
    wide = torch.randn(7, 80).bfloat16()  # rows of 64 channels inside rows of 80, as a split leaves them
    check_rounded_once(sl.small_linear(wide[:, :64], sl.pack_weight(w)), wide[:, :64], w)


def test_no_rows_gives_an_empty_product():
    x, w = operands(0, 96, 64)
    assert sl.small_linear(x, sl.pack_weight(w)).shape == (0, 96)


def test_past_max_rows_the_product_is_the_gemm_librarys():
    x, w = operands(7, 100, 96)
    packed = dataclasses.replace(sl.pack_weight(w), max_rows=4)
    assert torch.equal(sl.small_linear(x, packed), torch.nn.functional.linear(x, w))
    check_rounded_once(sl.small_linear(x[:4], packed), x[:4], w)


def test_a_nan_row_stays_in_its_row():
    x, w = operands(3, 70, 64)
    x[1, 5] = float("nan")
    y = sl.small_linear(x, sl.pack_weight(w))
    assert torch.isnan(y[1]).all() and not torch.isnan(y[[0, 2]]).any()


def test_other_dtypes_and_autograd_go_through_f_linear():
    x, w = operands(3, 70, 64)
    packed = sl.pack_weight(w)
    xf = x.float().requires_grad_()
    y = sl.small_linear(xf, packed)
    assert y.dtype == torch.float32 and torch.equal(y, torch.nn.functional.linear(xf, w.float()))
    y.sum().backward()
    torch.testing.assert_close(xf.grad, w.float().sum(0).expand(3, 64))
    xb = x.clone().requires_grad_()
    sl.small_linear(xb, packed).sum().backward()
    assert xb.grad is not None


def test_what_the_kernel_cannot_take_is_not_packed(monkeypatch):
    w = torch.randn(64, 32)
    assert sl.pack_weight(w) is None  # float32
    assert sl.pack_weight(w.bfloat16()[:, :31]) is None  # K odd
    assert sl.pack_weight(w.bfloat16()[None]) is None  # not a matrix
    monkeypatch.setattr(sl, "kernel_unavailable", lambda: "off")
    assert sl.pack_weight(w.bfloat16()) is None


def test_compiled_with_dynamic_rows_equals_eager():
    x, w = operands(9, 130, 96)
    packed = sl.pack_weight(w)
    f = torch.compile(lambda x: sl.small_linear(x, packed) * 2, fullgraph=True, dynamic=True)
    for T in (1, 4, 9):
        assert torch.equal(f(x[:T]), sl.small_linear(x[:T], packed) * 2)


@pytest.mark.parametrize("p", [2.0, 3.0, 1.5])
@pytest.mark.parametrize("T", [1, 4, 9])
@pytest.mark.parametrize("N,K,group", [(512, 512, 32), (512, 96, 128), (100, 96, 20), (130, 64, 130)])
def test_moments_are_each_groups_moment_of_the_rounded_product(p, T, N, K, group):
    """sum |y|^p over each group of outputs (groups inside a tile, across tiles, one for all),
    y as small_linear rounds it: to float32 summation order."""
    from qkmla.norms import moment

    x, w = operands(T, N, K, seed=1)
    packed = sl.pack_weight(w)
    m = sl.small_linear_moments(x, packed, group, p)
    y = sl.small_linear(x, packed)
    want = moment(y.unflatten(-1, (-1, group)), "lp", p).squeeze(-1)
    assert m.dtype == torch.float32 and m.shape == (T, N // group)
    torch.testing.assert_close(m, want, rtol=group * 2.0 ** -22, atol=0)
    assert m.numel() == 1 or m.std() > 0  # groups that differ


def test_moments_take_leading_dimensions_strided_rows_and_the_gemm_librarys_rows():
    x, w = operands(5, 96, 64, lead=(2, 3))
    packed = sl.pack_weight(w)
    m = sl.small_linear_moments(x, packed, 32)
    assert m.shape == (2, 3, 5, 3)
    torch.testing.assert_close(m[1, 2], sl.small_linear_moments(x[1, 2].clone(), packed, 32))
    wide = torch.randn(7, 80).bfloat16()
    torch.testing.assert_close(sl.small_linear_moments(wide[:, :64], packed, 32),
                               sl.small_linear_moments(wide[:, :64].contiguous(), packed, 32))
    gemm = dataclasses.replace(packed, max_rows=2)
    want = sl.small_linear(x[0, 0], gemm).float().unflatten(-1, (3, 32)).square().sum(-1)
    torch.testing.assert_close(sl.small_linear_moments(x[0, 0], gemm, 32), want, rtol=1e-6, atol=0)


def test_moments_of_other_dtypes_are_the_torch_reference():
    x, w = operands(3, 96, 64)
    m = sl.small_linear_moments(x.double(), sl.pack_weight(w), 32, 3.0)
    want = (x.double() @ w.double().T).abs().pow(3).unflatten(-1, (3, 32)).sum(-1)
    assert m.dtype == torch.float64
    torch.testing.assert_close(m, want)


def test_moments_refuse_a_group_that_does_not_divide_the_rows_and_p_not_positive():
    x, w = operands(3, 96, 64)
    packed = sl.pack_weight(w)
    for group in (0, 5, 192):
        with pytest.raises(ValueError, match="group: expected a positive divisor of the weight's 96 rows"):
            sl.small_linear_moments(x, packed, group)
    with pytest.raises(ValueError, match="p: expected p > 0"):
        sl.small_linear_moments(x, packed, 32, 0.0)


def test_moments_compiled_with_dynamic_rows_equal_eager():
    x, w = operands(9, 128, 96)
    packed = sl.pack_weight(w)
    f = torch.compile(lambda x: sl.small_linear_moments(x, packed, 32).rsqrt(), fullgraph=True, dynamic=True)
    for T in (1, 4, 9):
        torch.testing.assert_close(f(x[:T]), sl.small_linear_moments(x[:T], packed, 32).rsqrt())


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("kind,p", [("rms", 2.0), ("l2", 2.0), ("lp", 3.0), ("lp", 2.0), ("lp", 1.5)])
def test_the_statistic_is_the_norms_statistic_of_the_moments(kind, p, T):
    """One op call: statistic_from_moment of small_linear_moments (p for lp, else 2), to float32 rounding."""
    from qkmla.norms import statistic_from_moment

    x, w = operands(T, 512, 512, seed=2)
    packed = sl.pack_weight(w)
    got = sl.small_linear_statistic(x, packed, 32, kind, p, eps=1e-5)
    want = statistic_from_moment(sl.small_linear_moments(x, packed, 32, p if kind == "lp" else 2.0), 32, kind, p, 1e-5)
    assert got.dtype == torch.float32 and got.shape == (T, 16)
    torch.testing.assert_close(got, want, rtol=4 * 2.0 ** -23, atol=0)
    assert got.std() > 0


def test_the_statistic_of_other_dtypes_and_bad_arguments():
    from qkmla.norms import statistic

    x, w = operands(3, 96, 64)
    packed = sl.pack_weight(w)
    got = sl.small_linear_statistic(x.double(), packed, 32, "rms", eps=1e-6)
    want = statistic((x.double() @ w.double().T).unflatten(-1, (3, 32)), "rms", eps=1e-6).squeeze(-1)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="kind: expected one of"):
        sl.small_linear_statistic(x, packed, 32, "max")
    with pytest.raises(ValueError, match="group: expected a positive divisor"):
        sl.small_linear_statistic(x, packed, 5, "rms")
    with pytest.raises(ValueError, match="p: expected p > 0"):
        sl.small_linear_statistic(x, packed, 32, "lp", p=-1.0)


def test_the_statistic_compiled_equals_eager():
    x, w = operands(9, 128, 96)
    packed = sl.pack_weight(w)
    f = torch.compile(lambda x: sl.small_linear_statistic(x, packed, 32, "rms") * 2, fullgraph=True, dynamic=True)
    for T in (1, 9):
        torch.testing.assert_close(f(x[:T]), sl.small_linear_statistic(x[:T], packed, 32, "rms") * 2)
