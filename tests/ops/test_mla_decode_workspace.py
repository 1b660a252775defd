"""The torch backend's scratch buffers: kept per thread, role, dtype and device on the CPU."""

import threading

import torch

from qkmla.ops.mla_decode import mla_decode_with_kvcache, workspace


def test_a_role_gets_the_same_memory_while_it_fits_and_grows_past_it():
    workspace.release()
    a = workspace.scratch("rows", (4, 16, 8), torch.float32, "cpu")
    b = workspace.scratch("rows", (2, 16, 8), torch.float32, "cpu")  # smaller: the same memory
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 16, 8) and b.is_contiguous()
    assert workspace.scratch("c", (4, 16, 8), torch.float32, "cpu").data_ptr() != a.data_ptr()
    assert workspace.scratch("rows", (4, 16, 8), torch.bfloat16, "cpu").data_ptr() != a.data_ptr()
    bigger = workspace.scratch("rows", (8, 16, 8), torch.float32, "cpu")
    assert workspace.scratch("rows", (8, 16, 8), torch.float32, "cpu").data_ptr() == bigger.data_ptr()
    workspace.release()
    assert "buffers" not in workspace._local.__dict__


def test_large_requests_and_other_threads_get_their_own_memory(monkeypatch):
    workspace.release()
    kept = workspace.scratch("rows", (64,), torch.float32, "cpu")
    other = []
    thread = threading.Thread(target=lambda: other.append(workspace.scratch("rows", (64,), torch.float32, "cpu")))
    thread.start()
    thread.join()
    assert other[0].data_ptr() != kept.data_ptr()
    monkeypatch.setattr(workspace, "MAX_KEPT_BYTES", 255)
    big = workspace.scratch("rows", (64,), torch.float32, "cpu")  # 256 bytes: fresh, not kept
    assert big.data_ptr() != kept.data_ptr()
    assert workspace.scratch("rows", (63,), torch.float32, "cpu").data_ptr() == kept.data_ptr()
    workspace.release()


def test_a_paged_decode_reuses_its_buffers_and_reads_no_stale_rows():
    """Two paged decodes of one shape read their chunks into the same kept buffers; a third,
    of another batch over other rows, equals a decode from freshly allocated buffers."""
    torch.manual_seed(0)

    def case(B, n_blocks=12, page=16, width=40, G=4):
        kv = torch.randn(n_blocks, page, width + G)
        kv[..., width:] = kv[..., width:].abs() + 0.5
        table = torch.randperm(n_blocks)[:B * 3].view(B, 3).int()
        return dict(q_lat=torch.randn(B, 1, 8, 32), q_rope=torch.randn(B, 1, 8, 8), kv_cache=kv[..., :width],
                    scale_cache=kv[..., width:], block_table=table, cache_seqlens=torch.randint(1, 48, (B,)).int(),
                    softmax_scale=0.3, backend="torch")

    workspace.release()
    mla_decode_with_kvcache(**case(3))
    kept = {role: t.data_ptr() for (role, _, _), t in workspace._local.buffers.items()}
    assert {"c", "k_rope", "key_scale"} <= set(kept)
    mla_decode_with_kvcache(**case(3))
    assert {role: t.data_ptr() for (role, _, _), t in workspace._local.buffers.items()} == kept
    other = case(2)
    reused = mla_decode_with_kvcache(**other)
    workspace.release()
    fresh = mla_decode_with_kvcache(**other)
    assert torch.equal(reused[0], fresh[0]) and torch.equal(reused[1], fresh[1])
    workspace.release()


def two_sequences(kv: torch.Tensor) -> dict:
    """Decode arguments for two sequences (20 and 31 slots) over kv [6, 16, 44]: rows of 40
    values, then 4 key scalars (made positive)."""
    return dict(q_lat=torch.randn(2, 1, 8, 32), q_rope=torch.randn(2, 1, 8, 8), kv_cache=kv[..., :40],
                scale_cache=kv[..., 40:].abs() + 0.5, block_table=torch.tensor([[3, 1], [0, 5]]).int(),
                cache_seqlens=torch.tensor([20, 31]).int(), softmax_scale=0.3, backend="torch")


def test_a_cache_written_under_autograd_is_read_into_fresh_tensors():
    """A model's forward in grad mode leaves its cache rows with a grad_fn; index_select refuses
    out= buffers for such a tensor, so that read allocates: the same values as without autograd, to
    roundoff (a call autograd records takes the torch backend's differentiable path, another order
    of the same sums: 6e-7 here on outputs up to 2.5)."""
    torch.manual_seed(1)
    args = two_sequences(torch.randn(6, 16, 44) * torch.ones(1, requires_grad=True))  # a non-leaf, as a written cache
    recorded = mla_decode_with_kvcache(**args)
    assert recorded[0].requires_grad
    with torch.no_grad():
        plain = mla_decode_with_kvcache(**args)
    torch.testing.assert_close(recorded[0].detach(), plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(recorded[1].detach(), plain[1], rtol=1e-5, atol=1e-5)


def test_decoding_under_inference_mode_leaves_buffers_the_next_no_grad_call_can_write():
    """Generation often runs under inference_mode and evaluation under no_grad, in one thread:
    a buffer first made under inference_mode must still take writes after it."""
    torch.manual_seed(2)
    args = two_sequences(torch.randn(6, 16, 44))
    workspace.release()
    with torch.inference_mode():
        first = mla_decode_with_kvcache(**args)
    with torch.no_grad():
        second = mla_decode_with_kvcache(**args)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    workspace.release()
