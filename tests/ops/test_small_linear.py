"""The CPU kernel for x W^T over a few rows (``ops/small_linear.cpp``) against float64 and ``F.linear``.

The kernel sums each output's K products in float32 and rounds it to bfloat16 once, so every
output is within half a bfloat16 step of the float64 product, plus float32 summation error.
Skipped where the kernel cannot run (no AVX-512 BF16, no compiler), with the reason.
"""

import dataclasses

import pytest
import torch

from qkmla.ops.small_linear import interface as sl
from qkmla.ops.statistic import statistic
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


def rounded_statistic(x, w, kind, p, eps):
    """The statistic of each group of float64 products rounded to bfloat16 (what a bf16 GEMM returns)."""
    from qkmla.ops.statistic import statistic

    G, group, K = w.shape
    y = (x.double() @ w.reshape(G * group, K).double().T).bfloat16().float()
    return statistic(y.unflatten(-1, (G, group)), kind, p, eps).squeeze(-1)


def group_operands(T, G, group, K, lead=(), seed=0, rows_between=0):
    """x [*lead, T, K] and w [G, group, K] bf16; with rows_between, w is a view with that many other
    rows after each group's (as vLLM's W_UK_T lies in kv_b_proj's weight, W_UV rows between heads)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, T, K, generator=g).bfloat16()
    w = torch.randn(G, group + rows_between, K, generator=g).bfloat16()
    return x, w[:, :group]


@pytest.mark.parametrize("T", [1, 4, 9])
@pytest.mark.parametrize("G,group,K", [(16, 32, 512), (3, 6, 80), (2, 8, 96), (1, 128, 64)])
@pytest.mark.parametrize("kind,p", [("rms", 2.0), ("l2", 2.0), ("lp", 3.0), ("lp", 2.0), ("lp", 1.5)])
def test_group_statistic_is_the_norms_statistic_of_the_rounded_products(kind, p, T, G, group, K):
    """Groups of four rows and of one (group 6), K in whole and part chunks of 32: each value is
    the statistic of the products rounded to bf16, up to a product whose float32 sum rounds the
    other way (one bf16 step of one value of the group)."""
    x, w = group_operands(T, G, group, K, seed=T + G)
    got = sl.group_statistic(x, w, kind, p, eps=1e-5)
    want = rounded_statistic(x, w, kind, p, 1e-5)
    assert got.dtype == torch.float32 and got.shape == (T, G)
    torch.testing.assert_close(got, want, rtol=2.0 ** -8, atol=0)
    assert (got - want).abs().div(want).median() < 1e-5  # most equal to float32 rounding
    assert got.numel() == 1 or got.std() > 0  # groups that differ


def test_group_statistic_reads_a_strided_weight_in_place_and_takes_leading_dims_and_strided_rows():
    x, w = group_operands(3, 4, 32, 128, lead=(2, 2), rows_between=32)  # 12 rows: the kernel's
    assert not w.is_contiguous() and sl.group_kernel_takes(w)
    got = sl.group_statistic(x, w, "rms")
    assert got.shape == (2, 2, 3, 4)
    assert torch.equal(got, sl.group_statistic(x, w.contiguous(), "rms"))  # the same sums, in the same order
    assert torch.equal(got[1, 1], sl.group_statistic(x[1, 1].clone(), w, "rms"))
    wide = torch.randn(7, 160).bfloat16()
    assert torch.equal(sl.group_statistic(wide[:, :128], w, "l2"),
                       sl.group_statistic(wide[:, :128].contiguous(), w, "l2"))
    assert sl.group_statistic(x[0, 0, :0], w, "rms").shape == (0, 4)


def test_group_statistic_of_other_dtypes_autograd_and_weights_it_does_not_take_is_the_torch_reference(monkeypatch):
    from qkmla.ops.statistic import statistic

    x, w = group_operands(3, 3, 32, 64)
    got = sl.group_statistic(x.double(), w.double(), "lp", 3.0, eps=1e-6)
    want = statistic((x.double() @ w.double().reshape(96, 64).T).unflatten(-1, (3, 32)), "lp", 3.0, 1e-6).squeeze(-1)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want)
    xg = x.float().requires_grad_()
    sl.group_statistic(xg, w, "rms").sum().backward()  # the reference path, differentiable
    assert xg.grad is not None and xg.grad.abs().sum() > 0
    assert not sl.group_kernel_takes(w.float()) and not sl.group_kernel_takes(w.transpose(1, 2))
    assert not sl.group_kernel_takes(w[0])
    monkeypatch.setattr(sl, "_KERNEL_READY", False)  # before the kernel has built: the reference
    torch.testing.assert_close(sl.group_statistic(x, w, "rms"), rounded_statistic(x, w, "rms", 2.0, 1e-6),
                               rtol=2.0 ** -8, atol=0)


def test_group_statistic_refuses_bad_arguments_before_any_work():
    x, w = group_operands(3, 3, 32, 64)
    with pytest.raises(ValueError, match="kind: expected one of"):
        sl.group_statistic(x, w, "max")
    with pytest.raises(ValueError, match="p: expected p > 0, got -1.0"):
        sl.group_statistic(x, w, "lp", p=-1.0)
    with pytest.raises(ValueError, match=r"w: expected \[G, group, 64\] \(x's last dim\), got \(3, 32, 48\)"):
        sl.group_statistic(x, w[..., :48], "rms")
    with pytest.raises(ValueError, match=r"w: expected \[G, group, 64\]"):
        sl.group_statistic(x, w.reshape(96, 64), "rms")


def test_group_statistic_compiled_with_dynamic_rows_equals_eager():
    x, w = group_operands(9, 4, 32, 96, rows_between=8)
    f = torch.compile(lambda x: sl.group_statistic(x, w, "rms") * 2, fullgraph=True, dynamic=True)
    for T in (1, 4, 9):
        torch.testing.assert_close(f(x[:T]), sl.group_statistic(x[:T], w, "rms") * 2)


def test_the_bound_group_statistic_equals_the_unbound_and_checks_once():
    x, w = group_operands(5, 4, 32, 96, rows_between=8)
    f = sl.bind_group_statistic(w, "lp", 3.0, 1e-5)
    assert torch.equal(f(x), sl.group_statistic(x, w, "lp", 3.0, 1e-5))
    wide = torch.randn(7, 120).bfloat16()
    assert torch.equal(f(wide[:, :96]), sl.group_statistic(wide[:, :96], w, "lp", 3.0, 1e-5))  # strided rows
    torch.testing.assert_close(f(x.double()), sl.group_statistic(x.double(), w, "lp", 3.0, 1e-5))  # the reference
    g = sl.bind_group_statistic(w.float(), "rms")  # a weight the kernel does not take: the reference throughout
    torch.testing.assert_close(g(x.float()), sl.group_statistic(x.float(), w.float(), "rms"))
    with pytest.raises(ValueError, match="kind: expected one of"):
        sl.bind_group_statistic(w, "max")
    with pytest.raises(ValueError, match="p: expected p > 0"):
        sl.bind_group_statistic(w, "lp", 0.0)
    with pytest.raises(ValueError, match=r"w: expected \[G, group, 96\]"):
        sl.bind_group_statistic(w[0], "rms")


def test_past_its_rows_the_group_statistic_is_the_gemms():
    """More rows than GROUP_KERNEL_MAX_ROWS (a prefill) go to F.linear and the statistic in torch,
    bound or not; the kernel itself gives the same values to one bf16 step of one product."""
    n = sl.GROUP_KERNEL_MAX_ROWS + 3
    x, w = group_operands(n, 4, 32, 96, rows_between=8)
    want = statistic(torch.nn.functional.linear(x, w.reshape(128, 96)).unflatten(-1, (4, 32)), "rms").squeeze(-1)
    assert torch.equal(sl.group_statistic(x, w, "rms"), want)
    assert torch.equal(sl.bind_group_statistic(w, "rms")(x), want)
    kernel = torch.ops.qkmla_cpu.group_statistic(x, w, "rms", 2.0, 1e-6)
    torch.testing.assert_close(kernel, want, rtol=2.0 ** -8, atol=0)
    assert torch.equal(sl.group_statistic(x[:sl.GROUP_KERNEL_MAX_ROWS], w, "rms"),
                       kernel[:sl.GROUP_KERNEL_MAX_ROWS])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_grouped_linear_is_its_reference_per_group_wherever_the_kernel_does_not_run(dtype):
    """GroupedLinear, the op a layer's W_UK is: each group's outputs and statistic equal the
    references in naive.py (the kernels, where they run, are held against float64 above)."""
    from qkmla.ops.small_linear import GroupedLinear, naive

    x, w = torch.randn(2, 3, 64, dtype=dtype), torch.randn(4, 8, 64, dtype=dtype)
    uk = GroupedLinear(w, pack=True)
    want = naive.small_linear(x, w.reshape(32, 64)).unflatten(-1, (4, 8))
    if uk.packed is None or dtype != torch.bfloat16:  # the reference ran
        assert torch.equal(uk(x), want)
    else:
        torch.testing.assert_close(uk(x), want, rtol=2.0 ** -8, atol=0)
    # Group by group it is each group's own product, to the GEMM's roundoff: one [.., 32] GEMM and
    # four [.., 8] ones may block and sum differently (they did on CI's CPU), so not bitwise.
    per_group = torch.stack([torch.nn.functional.linear(x.double(), w[g].double()) for g in range(4)], dim=-2)
    roundoff = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8}[dtype]  # one rounding of x's dtype
    torch.testing.assert_close(uk(x).double(), per_group, rtol=roundoff, atol=roundoff * per_group.abs().max().item())
    for kind, p in (("rms", 2.0), ("l2", 2.0), ("lp", 3.0)):
        reference = naive.group_statistic(x, w, kind, p, 1e-6)
        assert torch.equal(reference, statistic(want, kind, p, 1e-6).squeeze(-1))
        if dtype != torch.bfloat16:
            assert torch.equal(uk.statistic(x, kind, p), reference)
            assert torch.equal(uk.bind_statistic(kind, p)(x.reshape(-1, 64)), reference.reshape(-1, 4))
    assert torch.equal(naive.small_linear(x, w[0]), torch.nn.functional.linear(x, w[0]))
