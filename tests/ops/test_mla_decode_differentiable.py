"""The torch backend under autograd (``differentiable.py``): the fast paths' answer, and a gradient."""

import pytest
import torch

from qkmla.cache.latent import LatentCache
from qkmla.cache.storage import PagedLayout
from qkmla.ops.mla_decode import mla_decode_with_kvcache

SELECTIONS = {
    "causal": {},
    "visible_lens": dict(visible_lens=torch.tensor([[2, 9, 0], [6, 1, 3]])),
    # an entry listed twice counts twice; -1 and a slot past the length select nothing
    "indices": dict(indices=torch.tensor([[[0, 3, 3, -1]] * 3, [[5, 1, 7, 2]] * 3]), topk_length=torch.tensor([4, 3])),
}


@pytest.mark.parametrize("kv_format", ["dense", "int8", "fp8"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("groups", [0, 2], ids=["plain", "scalars"])
@pytest.mark.parametrize("selection", list(SELECTIONS))
def test_recording_a_gradient_gives_the_fast_paths_answer(kv_format, paged, groups, selection):
    """Queries that require grad go through the out-of-place path; its output and lse are the in-place paths'
    (contiguous, paged, sparse; dense and quantized rows), in both modes, over a cache whose never-written
    slots are NaN and whose second sequence is shorter than the first (slots past it hold rows)."""
    torch.manual_seed(0)
    d_c, d_r = (128, 64) if kv_format == "fp8" else (32, 8)
    layout = PagedLayout(4, block_table=torch.tensor([[3, 0, 5, 7], [1, 2, 4, 6]])) if paged else None
    cache = LatentCache(2, 16, d_c, d_r, groups, kv_format=kv_format, layout=layout, fill=float("nan"))
    cache.append(cache.plan(2, 9), c_kv=torch.randn(2, 9, d_c), k_rope=torch.randn(2, 9, d_r),
                 key_scale=torch.rand(2, 9, groups) + 0.5 if groups else None)
    cache.drop_last(torch.tensor([0, 3]))
    view = cache.decode_view()
    q_lat, q_rope = torch.randn(2, 3, 4, d_c), torch.randn(2, 3, 4, d_r)
    for mode in ("blockwise", "unified"):
        with torch.no_grad():
            want = mla_decode_with_kvcache(q_lat, q_rope, **view, softmax_scale=0.3, backend="torch", mode=mode,
                                           **SELECTIONS[selection])
        got = mla_decode_with_kvcache(q_lat.clone().requires_grad_(), q_rope, **view, softmax_scale=0.3,
                                      backend="torch", mode=mode, **SELECTIONS[selection])
        assert got[0].requires_grad
        torch.testing.assert_close(got[0].detach(), want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1].detach(), want[1], rtol=1e-5, atol=1e-5)  # -inf where nothing is seen
        got[0].sum().backward()


def test_a_sparse_decode_passes_gradcheck():
    """The gradient with respect to the queries, the rows and the key scalars of a top-k decode through a
    block table, against finite differences (float64)."""
    torch.manual_seed(1)
    table, lens = torch.tensor([[3, 0, 5], [1, 2, 4]]), torch.tensor([10, 7])
    inputs = [t.requires_grad_() for t in (torch.randn(2, 2, 4, 16, dtype=torch.float64),
                                           torch.randn(2, 2, 4, 8, dtype=torch.float64),
                                           torch.randn(6, 4, 24, dtype=torch.float64),
                                           torch.rand(6, 4, 2, dtype=torch.float64) + 0.5)]
    indices = torch.tensor([[[0, 9, 4], [2, 2, -1]], [[6, 0, 3], [1, 8, 5]]])
    assert torch.autograd.gradcheck(lambda q, r, kv, s: mla_decode_with_kvcache(
        q, r, kv, table, lens, s, softmax_scale=0.3, backend="torch", indices=indices)[0], inputs)


def test_auto_sends_a_recording_call_from_triton_to_torch(monkeypatch):
    """On CUDA "auto" picked Triton under autograd too, whose op has no backward: a decode step
    trained through failed in backward there. Seen from select_backend's answer (no GPU here)."""
    from qkmla.ops.mla_decode import backends

    monkeypatch.setattr(backends, "select_backend", lambda *a, **k: "triton")
    q, r, kv = torch.randn(1, 1, 4, 32), torch.randn(1, 1, 4, 16), torch.randn(1, 8, 48)
    assert backends.resolve_backend("auto", q, r, kv) == "triton"
    q.requires_grad_()
    assert backends.resolve_backend("auto", q, r, kv) == "torch"
    with torch.no_grad():
        assert backends.resolve_backend("auto", q, r, kv) == "triton"
    with pytest.raises(ValueError, match=r"^backend: 'triton' has no backward"):
        backends.resolve_backend("triton", q, r, kv)
    assert backends.resolve_backend("auto", q.detach(), r, kv, written={"c_kv": torch.ones(1, requires_grad=True)}) \
        == "torch"
