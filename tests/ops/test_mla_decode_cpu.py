"""The CPU kernel of the MLA decode op (``cpu_kernel.cpp``) against the spec, ``naive.py``.

The kernel takes bfloat16 queries and rows, so each case of the backends' grid
(``test_mla_decode_backends.py``: paged and contiguous caches, lengths 1, 97, 1025 and 0 in one
batch, G in {1, 4, h}, S_q in {1, 2}, plain MLA and four norms' key scalars, causal or prefix
visibility) is cast to bfloat16 and held to two bounds: its log-sum-exp equals the float32 spec's
on the same bfloat16 values to float32 roundoff (the scores are exact products summed in
float32), and its output is as close to the float32 spec as the spec computed in bfloat16 is,
give or take a factor 2 (the torch backend's bound). Skipped where the kernel cannot run (no
AVX-512 BF16, no compiler), with the reason. The sparse (top-k) decode's cases
(``test_mla_decode_sparse.py``) are held to the same bounds.
"""

import pytest
import torch

from qkmla.ops.mla_decode import mla_decode_with_kvcache, naive_mla_decode, select_backend
from qkmla.ops import cpu_extension
from qkmla.ops.mla_decode import cpu_kernel
from qkmla.ops.mla_decode.cpu_kernel import cpu_unsupported_for

from . import test_mla_decode_sparse as sparse
from .test_mla_decode_backends import GRID, H, LENGTHS, case_id, decode_inputs

REASON = cpu_unsupported_for("cpu", 32, 16, torch.bfloat16)
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
HALF = ("q_lat", "q_rope", "kv_cache", "scale_cache")


def in_bf16(args: dict) -> dict:
    return {k: v.to(torch.bfloat16) if k in HALF and v is not None else v for k, v in args.items()}


def check_bf16_against_naive(args: dict, backend: str = "cpu") -> None:
    """``args`` (float32, from ``decode_inputs``) decoded in bfloat16 by ``backend``, held to the
    module's two bounds."""
    half = in_bf16(args)
    on_half = {k: v.float() if k in HALF and v is not None else v for k, v in half.items()}
    ref, ref_lse = mla_decode_with_kvcache(**on_half, backend="naive")  # float32 spec on the bf16 values
    table = half["block_table"]
    if table is None:  # a contiguous cache is one block per sequence
        table = torch.arange(half["q_lat"].shape[0])[:, None]
    spec_bf16, _ = naive_mla_decode(half["q_lat"], half["q_rope"], half["kv_cache"], table,
                                    half["cache_seqlens"], half["scale_cache"], half["softmax_scale"],
                                    compute_dtype=torch.bfloat16, mode=half["mode"],
                                    visible_lens=half.get("visible_lens"), indices=half.get("indices"),
                                    topk_length=half.get("topk_length"))
    out, lse = mla_decode_with_kvcache(**half, backend=backend)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and not torch.isnan(out).any()
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)  # -inf exactly where no slot is visible
    torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=1e-5, atol=1e-5)
    assert (~seen).sum() == 0 or out[~seen].abs().max() == 0
    spec_err = (spec_bf16.float() - ref)[seen].abs().max()
    err = (out.float() - ref)[seen].abs().max()
    assert err <= 2 * spec_err, (err, spec_err)


@pytest.mark.parametrize("layout,G,S_q,norm,visibility", GRID, ids=[case_id(c) for c in GRID])
def test_cpu_kernel_matches_naive(layout, G, S_q, norm, visibility):
    check_bf16_against_naive(decode_inputs(layout, G, S_q, norm, visibility))


@pytest.mark.parametrize("splits", [2, 3, 40])
@pytest.mark.parametrize("norm", ["plain", "blockwise", "unified"])
def test_keys_split_across_work_items_merge_exactly(monkeypatch, splits, norm):
    """Split-K as a thread count above 1 makes it (the suite runs on one thread): each split is
    a whole number of chunks, some splits are empty (40 over 1025 keys), and the merge weighs
    each by its max and sum: within roundoff of one pass over every key."""
    args = in_bf16(decode_inputs("paged", 4, 2, norm, "prefix"))
    one_pass = mla_decode_with_kvcache(**args, backend="cpu")
    monkeypatch.setattr(cpu_kernel, "_splits", lambda queries, longest: splits)
    split = mla_decode_with_kvcache(**args, backend="cpu")
    torch.testing.assert_close(split[1], one_pass[1], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(split[0], one_pass[0], rtol=0, atol=1.6e-2)  # one bf16 rounding apart at most
    check_bf16_against_naive(decode_inputs("paged", 4, 2, norm, "prefix"))


@pytest.mark.parametrize("heads,G", [(16, 16), (128, 128), (40, 8), (24, 3)])
def test_deepseek_widths_and_head_counts(monkeypatch, heads, G):
    """d_c 512, d_r 64 (DeepSeek's), in vLLM's row [c | k_rope | r] (column views of one row),
    with head counts that fill 16 lanes, several groups of them, or leave lanes over, and
    groups that span lane groups (24 heads, G 3: 8 heads a group)."""
    from . import test_mla_decode_backends as grid

    monkeypatch.setattr(grid, "H", heads)
    monkeypatch.setattr(grid, "LENGTHS", (300, 17, 0))
    args = in_bf16(grid.decode_inputs("paged", G, 1, "blockwise", "causal", d_c=512))
    assert args["q_lat"].shape == (3, 1, heads, 512)
    wide = torch.cat((args["kv_cache"], args["scale_cache"]), dim=-1)
    views = dict(kv_cache=wide[..., :-G], scale_cache=wide[..., -G:])
    check_bf16_against_naive({k: v.float() if k in HALF and v is not None else v for k, v in
                              {**args, **views}.items()})
    got = mla_decode_with_kvcache(**{**args, **views}, backend="cpu")
    alone = mla_decode_with_kvcache(**args, backend="cpu")  # the same rows held in two caches
    assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])


SPARSE_GRID = [(layout, G, S_q, norm) for layout, G, S_q, norm in sparse.GRID if S_q == 2 or G == 4]


@pytest.mark.parametrize("layout,G,S_q,norm", SPARSE_GRID, ids=[sparse.case_id(c) for c in SPARSE_GRID])
def test_sparse_decode_matches_naive(layout, G, S_q, norm):
    """indices (``test_mla_decode_sparse.py``: selected slots in any order, one twice, -1, past
    the length, a query that selects nothing), with topk_length or without: each query reads
    its selected slots' rows and key scalars, packed to the front (``selection.packed_selection``)."""
    args = sparse.sparse_inputs(layout, G, S_q, norm, topk_length=G == 4)
    check_bf16_against_naive(args)
    out, lse = mla_decode_with_kvcache(**in_bf16(args), backend="cpu")
    assert out[1, -1].abs().max() == 0 and bool((lse[1, -1] == float("-inf")).all())  # selects nothing


@pytest.mark.parametrize("splits", [2, 40])
def test_sparse_keys_split_across_work_items_merge_exactly(monkeypatch, splits):
    """A sparse query's selected keys split into whole chunks, most of 40 splits empty."""
    monkeypatch.setattr(sparse, "TOPK", 80)
    args = in_bf16(sparse.sparse_inputs("paged", 4, 2, "blockwise", topk_length=True))
    one_pass = mla_decode_with_kvcache(**args, backend="cpu")
    monkeypatch.setattr(cpu_kernel, "_splits", lambda queries, longest: splits)
    split = mla_decode_with_kvcache(**args, backend="cpu")
    torch.testing.assert_close(split[1], one_pass[1], rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(split[0], one_pass[0], rtol=0, atol=1.6e-2)  # one bf16 rounding apart at most


def test_sparse_decode_at_deepseek_widths_in_vllms_rows(monkeypatch):
    """d_c 512, d_r 64, 16 heads, key scalars in the row [c | k_rope | r]: a top-64 selection
    over 300 slots reads the same as the rows held in two caches, and as the spec."""
    from . import test_mla_decode_backends as grid

    monkeypatch.setattr(grid, "H", 16)
    monkeypatch.setattr(grid, "LENGTHS", (300, 17, 0))
    args = grid.decode_inputs("paged", 16, 1, "blockwise", "causal", d_c=512)
    del args["visible_lens"]
    args["indices"] = sparse.sparse_indices((300, 17, 0), 1, topk=64)
    check_bf16_against_naive(args)
    half = in_bf16(args)
    wide = torch.cat((half["kv_cache"], half["scale_cache"]), dim=-1)
    views = dict(kv_cache=wide[..., :-16], scale_cache=wide[..., -16:])
    got = mla_decode_with_kvcache(**{**half, **views}, backend="cpu")
    alone = mla_decode_with_kvcache(**half, backend="cpu")
    assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])


def test_ignoring_the_key_scalars_fails_the_check(monkeypatch):
    """Negative control: the kernel run as plain MLA on QK-normed inputs is caught by the bounds."""
    args = decode_inputs("paged", 4, 1, "blockwise", "causal")
    monkeypatch.setitem(cpu_kernel.MODE_CODES, "blockwise", 0)
    with pytest.raises(AssertionError):
        check_bf16_against_naive(args)


def test_float32_scalars_beside_bfloat16_rows():
    """A LatentCache keeps its scalars in float32 beside bfloat16 rows: read as they are."""
    args = decode_inputs("paged", H, 1, "l2", "causal")
    half = {**in_bf16(args), "scale_cache": args["scale_cache"]}
    out, lse = mla_decode_with_kvcache(**half, backend="cpu")
    ref = mla_decode_with_kvcache(**{**half, "kv_cache": half["kv_cache"].float(), "q_lat": half["q_lat"].float(),
                                     "q_rope": half["q_rope"].float()}, backend="naive")
    seen = torch.isfinite(ref[1])
    torch.testing.assert_close(lse[seen], ref[1][seen], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float()[seen], ref[0][seen], rtol=2e-2, atol=2e-2)


def test_auto_picks_the_kernel_for_bfloat16_on_the_cpu_and_torch_otherwise():
    assert select_backend("auto", "cpu", 512, 64, torch.bfloat16) == "cpu"
    assert select_backend("auto", "cpu", 512, 64, torch.float32) == "torch"
    assert select_backend("auto", "cpu", 512, 64, torch.bfloat16, "fp8") == "torch"
    assert select_backend("auto", "cpu", 48, 64, torch.bfloat16) == "torch"  # d_c not a multiple of 32
    assert select_backend("auto", "cpu", 512, 64) == "torch"  # dtype unknown: not chosen
    args = in_bf16(decode_inputs("paged", 4, 1, "blockwise", "causal"))
    auto = mla_decode_with_kvcache(**args, backend="auto")
    cpu = mla_decode_with_kvcache(**args, backend="cpu")
    assert torch.equal(auto[0], cpu[0]) and torch.equal(auto[1], cpu[1])
    # More query heads per sequence than AUTO_MAX_QUERY_HEADS (40 x 1): the torch backend's GEMMs
    wide = in_bf16(paged_case((30, 9), 40, 8, 64, 16, 16))
    assert 40 > cpu_kernel.AUTO_MAX_QUERY_HEADS
    auto = mla_decode_with_kvcache(**wide, backend="auto")
    torch_backend = mla_decode_with_kvcache(**wide, backend="torch")
    assert torch.equal(auto[0], torch_backend[0]) and torch.equal(auto[1], torch_backend[1])


@pytest.mark.parametrize("change, named", [
    (lambda a: {**a, "q_lat": a["q_lat"].float(), "q_rope": a["q_rope"].float()}, "kv_cache, q_lat"),
    (lambda a: {**a, "kv_cache": a["kv_cache"].float()}, "kv_cache"),
    (lambda a: {**a, "scale_cache": a["scale_cache"].half()}, "scale_cache"),
    (lambda a: {**a, "kv_cache": a["kv_cache"].transpose(1, 2).contiguous().transpose(1, 2)}, "kv_cache"),
    (lambda a: {**a, "scale_cache": a["scale_cache"].transpose(1, 2).contiguous().transpose(1, 2)}, "scale_cache"),
    (lambda a: {**a, "q_lat": a["q_lat"].requires_grad_()}, "q_lat"),
    (lambda a: {**a, "q_rope": a["q_rope"].requires_grad_()}, "q_rope"),
])
def test_explicit_cpu_refuses_inputs_it_does_not_take(change, named):
    """Asked for by name, the kernel refuses (naming the argument) what ``auto`` would hand the
    torch backend: float32 queries or rows, float16 scalars, strided channels, autograd."""
    args = change(in_bf16(decode_inputs("paged", 4, 1, "blockwise", "causal")))
    with pytest.raises(ValueError, match=named):
        mla_decode_with_kvcache(**args, backend="cpu")
    if not args["q_lat"].requires_grad:
        out, _ = mla_decode_with_kvcache(**args, backend="auto")  # auto falls back to the torch backend
        assert not torch.isnan(out).any()


def test_lengths_past_the_capacity_are_refused_before_any_read():
    args = in_bf16(decode_inputs("paged", 4, 1, "blockwise", "causal"))
    capacity = args["kv_cache"].shape[1] * args["block_table"].shape[1]
    with pytest.raises(ValueError, match="cache_seqlens"):
        mla_decode_with_kvcache(**{**args, "cache_seqlens": torch.tensor([capacity + 1, 1, 1, 0], dtype=torch.int32)},
                                backend="cpu")
    table = args["block_table"].clone()
    table[0, 0] = -1
    with pytest.raises(ValueError, match="block_table"):
        mla_decode_with_kvcache(**{**args, "block_table": table}, backend="cpu")
    assert len(LENGTHS) == 4


def paged_case(lengths, heads: int, G: int, d_c: int, d_r: int, block: int, S_q: int = 1, seed: int = 0) -> dict:
    """Float32 arguments over a paged cache of ``block``-slot blocks (shuffled table, NaN in
    every slot no sequence owns), blockwise key scalars, per-query prefixes."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = max(1, -(-max(lengths) // block))
    n_blocks = len(lengths) * per_seq + 2
    table = torch.randperm(n_blocks, generator=gen)[:len(lengths) * per_seq].view(len(lengths), per_seq)
    kv = torch.full((n_blocks, block, d_c + d_r), float("nan"))
    scales = torch.full((n_blocks, block, G), float("nan"))
    for b, n in enumerate(lengths):
        slot = torch.arange(n)
        where = (table[b, slot // block], slot % block)
        kv[where] = torch.randn(n, d_c + d_r, generator=gen)
        scales[where] = 0.5 + torch.rand(n, G, generator=gen)
    visible = torch.stack([torch.randint(0, n + 2, (S_q,), generator=gen) for n in lengths])
    return dict(q_lat=torch.randn(len(lengths), S_q, heads, d_c, generator=gen) * 0.3,
                q_rope=torch.randn(len(lengths), S_q, heads, d_r, generator=gen) * 0.3, kv_cache=kv,
                block_table=table.to(torch.int64), cache_seqlens=torch.tensor(lengths), scale_cache=scales,
                softmax_scale=0.3, mode="blockwise", visible_lens=visible, kv_format="dense")


@pytest.mark.parametrize("mode", ["blockwise", "unified"])
def test_odd_shapes_take_every_loop_of_the_kernel(mode):
    """21 heads (a lane group of 16 and one of 5: value tiles of 4 heads and of 1), G 3 (7 heads a
    group, spanning both lane groups), d_c 96 (value tiles of 4 and of 1 channel blocks), d_r 2,
    blocks of 5 slots, an int64 table, three query tokens with their own prefixes."""
    check_bf16_against_naive({**paged_case((0, 37, 70), 21, 3, 96, 2, 5, S_q=3), "mode": mode})


def test_nan_in_a_visible_row_or_scalar_comes_out_as_nan(monkeypatch):
    """As in the spec (and the torch backend), a NaN a query reads poisons its softmax: out and
    lse NaN for that sequence, the others untouched."""
    args = in_bf16(paged_case((40, 40), 16, 16, 64, 16, 16))
    args["visible_lens"] = None
    table = args["block_table"]
    for field, where in (("kv_cache", (table[0, 1], 3, 70)), ("scale_cache", (table[0, 0], 5, 2))):
        poisoned = {**args, field: args[field].clone()}
        poisoned[field][where] = float("nan")
        for splits in (1, 2):
            monkeypatch.setattr(cpu_kernel, "_splits", lambda queries, longest: splits)
            out, lse = mla_decode_with_kvcache(**poisoned, backend="cpu")
            ref_out, ref_lse = mla_decode_with_kvcache(**poisoned, backend="torch")
            assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)) and torch.isnan(lse[0]).any()
            assert torch.isnan(out[0]).any() and not torch.isnan(out[1]).any() and not torch.isnan(lse[1]).any()


def test_a_stale_build_lock_is_cleared_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """The extension loader waits without a timeout on a lock a killed build left behind."""
    import os
    import time

    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    lock = tmp_path / "lock"
    lock.touch()
    cpu_extension.clear_stale_lock("x")
    assert lock.exists()
    old = time.time() - cpu_extension.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    cpu_extension.clear_stale_lock("x")
    assert not lock.exists()


def test_a_failed_build_or_the_switch_leaves_the_torch_backend(monkeypatch):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError()  # an exception without a message
    monkeypatch.setattr(cpp_extension, "load", broken)
    cpu_extension.build.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="did not build: RuntimeError"):
            assert select_backend("auto", "cpu", 512, 64, torch.bfloat16) == "torch"
        with pytest.raises(ValueError, match="did not build"):
            select_backend("cpu", "cpu", 512, 64, torch.bfloat16)
        cpu_extension.build.cache_clear()
        monkeypatch.setenv("QKMLA_CPU_KERNEL", "0")
        assert select_backend("auto", "cpu", 512, 64, torch.bfloat16) == "torch"
        with pytest.raises(ValueError, match="QKMLA_CPU_KERNEL=0"):
            select_backend("cpu", "cpu", 512, 64, torch.bfloat16)
    finally:
        cpu_extension.build.cache_clear()


def test_queries_of_two_dtypes_are_refused_by_every_backend():
    args = in_bf16(decode_inputs("paged", 4, 1, "blockwise", "causal"))
    for backend in ("auto", "torch", "cpu"):
        with pytest.raises(ValueError, match="q_lat, q_rope: expected one dtype"):
            mla_decode_with_kvcache(**{**args, "q_rope": args["q_rope"].float()}, backend=backend)
