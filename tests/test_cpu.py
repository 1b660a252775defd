"""The opt-in CPU decode projections (qkmla.cpu): the few-row split across CPU threads against
F.linear, and what optimize_for_decode swaps (fixtures ``threads`` and ``ops_of``: tests/conftest.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkmla.cpu import MAX_ROWS, DecodeLinear, optimize_for_decode, split_blocks, split_linear


def test_split_blocks_is_largest_divisor_up_to_threads():
    assert split_blocks(576, 16) == 16
    assert split_blocks(6, 4) == 3
    assert split_blocks(7, 4) == 1
    assert split_blocks(3, 8) == 3


@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_split_matches_linear_and_runs_as_bmm(rows, bias, threads, ops_of):
    threads(2)
    gen = torch.Generator().manual_seed(rows)
    layer = nn.Linear(40, 36, bias=bias).double()
    model = optimize_for_decode(nn.Sequential(layer)).eval()
    assert type(model[0]) is DecodeLinear and model[0].weight is layer.weight  # the same parameters
    x = torch.randn(rows, 1, 40, generator=gen, dtype=torch.float64)
    got = model(x)
    assert got.shape == (rows, 1, 36)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-13, atol=1e-13)
    ops = ops_of(lambda: model(x))
    assert "bmm" in ops and not {"mm", "addmm"} & set(ops)
    model.train()  # training never takes the split
    assert "bmm" not in ops_of(lambda: model(x))
    assert set(model.state_dict()) == {"0.weight"} | ({"0.bias"} if bias else set())


def test_float32_and_bfloat16_agree_with_linear(threads):
    threads(2)
    x = torch.randn(1, 1, 256)
    w = torch.randn(64, 256)
    torch.testing.assert_close(split_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(split_linear(xb, wb).float(), F.linear(xb, wb).float(), rtol=2e-2, atol=2e-1)


def test_falls_back_to_linear_where_the_split_does_not_apply(threads, ops_of):
    threads(2)
    w = torch.randn(36, 40)
    many = torch.randn(MAX_ROWS + 1, 40)
    assert "bmm" not in ops_of(lambda: split_linear(many, w))  # MKL threads a taller product itself
    assert "bmm" not in ops_of(lambda: split_linear(torch.randn(1, 40), torch.randn(7, 40)))  # 7 rows: no split
    assert "bmm" not in ops_of(lambda: split_linear(torch.randn(1, 36), w.t()))  # not contiguous
    threads(1)
    assert "bmm" not in ops_of(lambda: split_linear(torch.randn(1, 40), w))
    torch.testing.assert_close(split_linear(many, w), F.linear(many, w))


def test_hooked_or_wrapped_layer_keeps_its_own_forward(threads):
    threads(2)
    layer = nn.Linear(8, 4)
    calls = []
    layer.register_forward_hook(lambda mod, inp, out: calls.append(out.shape))
    model = optimize_for_decode(nn.Sequential(layer)).eval()
    assert model[0] is layer
    model(torch.randn(1, 8))
    assert calls == [torch.Size([1, 4])]

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    scaled = Scaled(8, 4)
    x = torch.randn(1, 8)
    model = optimize_for_decode(nn.Sequential(scaled)).eval()
    torch.testing.assert_close(model(x), 2 * F.linear(x, scaled.weight, scaled.bias))
    with pytest.raises(ValueError, match="model: expected an nn.Module"):
        optimize_for_decode([layer])


def test_gradients_match_linear(threads):
    threads(2)
    layer = nn.Linear(12, 8).double()
    x = torch.randn(2, 12, dtype=torch.float64, requires_grad=True)
    split_linear(x, layer.weight, layer.bias).square().sum().backward()
    grads = [t.grad.clone() for t in (x, layer.weight, layer.bias)]
    for t in (x, layer.weight, layer.bias):
        t.grad = None
    F.linear(x, layer.weight, layer.bias).square().sum().backward()
    for got, t in zip(grads, (x, layer.weight, layer.bias)):
        torch.testing.assert_close(got, t.grad, rtol=1e-12, atol=1e-12)


def test_threads_are_fixed_when_swapped_and_updated_by_a_second_call(threads):
    threads(2)
    model = optimize_for_decode(nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 7))).eval()
    assert [layer.blocks for layer in model] == [2, 1]  # 7 rows: no 2-way split
    threads(1)
    assert model[0].blocks == 2  # fixed at the swap, not read at every call
    optimize_for_decode(model, threads=4)
    assert [layer.blocks for layer in model] == [4, 1]
    for bad in (0, -2, 1.5, True, "4"):
        with pytest.raises(ValueError, match="threads: expected a positive int"):
            optimize_for_decode(model, threads=bad)


def test_split_matmul_op_is_a_well_formed_custom_op():
    x, w = torch.randn(3, 40), torch.randn(36, 40)
    torch.library.opcheck(torch.ops.qkmla.split_matmul, (x, w, 4))
    torch.testing.assert_close(torch.ops.qkmla.split_matmul(x, w, 4), F.linear(x, w))


def test_fullgraph_compile_runs_the_split_as_one_op(threads):
    """A compiled step can use the opt-in: the product is traced as ``qkmla::split_matmul``."""
    threads(2)
    torch._dynamo.reset()
    layer = nn.Linear(40, 36)
    model = optimize_for_decode(nn.Sequential(layer)).eval()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    x = torch.randn(1, 1, 40)
    with torch.no_grad():
        got = torch.compile(model, fullgraph=True, backend=backend)(x)
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias))
    assert len(graphs) == 1 and "qkmla.split_matmul" in graphs[0]
