"""The sparse (top-k) decode of the MLA decode op: ``indices`` and ``topk_length`` on every backend.

Cases reuse the backends' grid (``test_mla_decode_backends.py``: paged caches with a shuffled
block table and contiguous ones, NaN, or 0xFF bytes, in every slot no sequence owns, lengths 1,
97, 1025 and 0 in one batch, G in {1, 4, h}, S_q in {1, 2}, plain MLA and four norms' key
scalars) with each query's indices drawn by :func:`sparse_indices`: up to TOPK - 5 distinct
slots of its sequence in random order (fewer than the 97 and 1025 slots of the long
sequences), one of them listed twice, -1, -5, the length itself and a position past the
capacity (all of which select nothing), all shuffled; one query of every case selects nothing
at all (every entry -1), and the zero-length sequence's entries all lie past its length.
The torch backend runs the grid, over dense and quantized rows; Triton's interpreter a subset
covering every value of every axis; the CPU kernel's cases are in ``test_mla_decode_cpu.py``.
"""

import itertools

import pytest
import torch

from qkmla.ops.mla_decode import interface, mla_decode_with_kvcache, naive_mla_decode

from .test_mla_decode_backends import DEVICE, H, LENGTHS, NORMS, check_against_naive, decode_inputs

TOPK = 24


def sparse_indices(lengths, S_q: int, topk=None, seed: int = 0, dtype=torch.int32) -> torch.Tensor:
    """[B, S_q, topk (default TOPK)]: per query, min(n, topk - 5) distinct slots of its sequence in
    random order, one listed twice, and -1, -5, n and n + 10**6 (none of which selects a slot),
    shuffled; the last query of sequence 1 selects nothing (all -1)."""
    topk = TOPK if topk is None else topk
    gen = torch.Generator().manual_seed(seed)
    out = torch.full((len(lengths), S_q, topk), -1, dtype=torch.int64)
    for b, n in enumerate(lengths):
        for t in range(S_q):
            chosen = torch.randperm(n, generator=gen)[:min(n, topk - 5)]
            twice = chosen[:1]  # a slot listed twice counts twice
            entries = torch.cat((chosen, twice, torch.tensor([-1, -5, n, n + 10 ** 6])))
            out[b, t, :entries.numel()] = entries
            out[b, t] = out[b, t, torch.randperm(topk, generator=gen)]
    out[1, -1] = -1
    return out.to(dtype).to(DEVICE)


def sparse_inputs(layout: str, G: int, S_q: int, norm: str, kv_format: str = "dense", topk_length: bool = False,
                  seed: int = 0, index_dtype=torch.int32) -> dict:
    """Keyword arguments of a sparse decode: ``decode_inputs`` with indices (and topk_length
    [B]: all, none, some and more than topk entries) of ``index_dtype`` instead of a visibility rule."""
    args = decode_inputs(layout, G, S_q, norm, "causal", seed=seed, kv_format=kv_format)
    del args["visible_lens"]
    args["indices"] = sparse_indices(LENGTHS, S_q, seed=seed, dtype=index_dtype)
    if topk_length:
        topk = args["indices"].shape[-1]
        args["topk_length"] = torch.tensor([topk, 0, 11, topk + 9], dtype=index_dtype, device=DEVICE)
    return args


def check_sparse(backend: str, args: dict, **kwargs) -> None:
    """``backend`` equals the spec, and the query that selects nothing has out 0 and lse -inf."""
    check_against_naive(backend, {**args, **kwargs})
    out, lse = mla_decode_with_kvcache(**args, **kwargs, backend=backend)
    assert out[1, -1].abs().max() == 0 and bool((lse[1, -1] == float("-inf")).all())
    assert out[3].abs().max() == 0 and bool((lse[3] == float("-inf")).all())  # the zero-length sequence


AXES = dict(layout=["paged", "contiguous"], G=[1, 4, H], S_q=[1, 2], norm=list(NORMS))
GRID = list(itertools.product(*AXES.values()))


def case_id(case) -> str:
    layout, G, S_q, norm = case
    return f"{layout}-G{G}-Sq{S_q}-{norm}"


@pytest.mark.parametrize("layout,G,S_q,norm", GRID, ids=[case_id(c) for c in GRID])
def test_torch_backend_matches_naive(layout, G, S_q, norm):
    index_dtype = torch.int64 if G == H else torch.int32  # both integer dtypes the op takes
    check_sparse("torch", sparse_inputs(layout, G, S_q, norm, topk_length=G == 4, index_dtype=index_dtype))


@pytest.mark.parametrize("norm", ["plain", "blockwise"])
def test_torch_backend_gathers_a_long_call_in_groups_of_queries_as_naive_does(monkeypatch, norm):
    """A call of many queries (a prefill chunk) gathers their rows a group of queries at a time
    (``GATHER_ROWS``): three queries of four sequences, one query's rows per group."""
    from qkmla.ops.mla_decode import torch_impl

    args = sparse_inputs("paged", 4, 3, norm, topk_length=True)
    groups = []
    gather = torch_impl._sparse_group
    monkeypatch.setattr(torch_impl, "GATHER_ROWS", len(LENGTHS) * TOPK)
    monkeypatch.setattr(torch_impl, "_sparse_group", lambda q_lat, *a, **k: groups.append(q_lat.shape[1]) or
                        gather(q_lat, *a, **k))
    check_sparse("torch", args)
    assert groups[:3] == [1, 1, 1]


QUANT_CASES = [(f, *case) for f, case in zip(itertools.cycle(("fp8", "int8", "int4")), GRID[::3])]


@pytest.mark.parametrize("kv_format,layout,G,S_q,norm", QUANT_CASES,
                         ids=[f"{c[0]}-{case_id(c[1:])}" for c in QUANT_CASES])
def test_torch_backend_reads_quantized_rows_as_naive_does(kv_format, layout, G, S_q, norm):
    check_sparse("torch", sparse_inputs(layout, G, S_q, norm, kv_format=kv_format, topk_length=S_q == 2))


@pytest.mark.parametrize("spacing", ["row", "padded-block"])
def test_torch_backend_reads_column_views_of_one_wide_row(spacing):
    """vLLM's layout, one row [c | k_rope | r] per slot handed over as column views, and blocks
    padded past their last slot ([n, 20, width][:, :16], whose slots cannot be flattened into one
    view): the same answer, exactly, as the rows held in two caches of their own."""
    args = sparse_inputs("paged", 4, 2, "blockwise", topk_length=True)
    kv, scales = args["kv_cache"], args["scale_cache"]
    n_blocks, page, width = kv.shape
    extra = 4 if spacing == "padded-block" else 0
    wide = torch.full((n_blocks, page + extra, width + 4), float("nan"), device=kv.device)[:, :page]
    wide[..., :width], wide[..., width:] = kv, scales
    want = mla_decode_with_kvcache(**args, backend="torch")
    got = mla_decode_with_kvcache(**{**args, "kv_cache": wide[..., :width], "scale_cache": wide[..., width:]},
                                  backend="torch")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# Every value of every axis, dense and quantized rows, topk_length or not, one split or several
# (with several, most splits of a query whose few entries lie early hold no selected key).
TRITON_CASES = [  # (layout, G, S_q, norm, kv_format, topk_length, num_splits)
    ("paged", 1, 1, "plain", "dense", False, 1), ("paged", 4, 2, "blockwise", "dense", True, 3),
    ("contiguous", H, 2, "unified", "dense", False, 2), ("paged", 4, 1, "l2", "fp8", True, 1),
    ("contiguous", 1, 2, "lp", "int8", False, 3), ("paged", H, 2, "blockwise", "int4", True, 2),
]


@pytest.mark.parametrize("layout,G,S_q,norm,kv_format,topk_length,num_splits", TRITON_CASES,
                         ids=[f"{case_id(c[:4])}-{c[4]}-{'topk_length' if c[5] else 'all'}-splits{c[6]}"
                              for c in TRITON_CASES])
def test_triton_backend_matches_naive(layout, G, S_q, norm, kv_format, topk_length, num_splits):
    pytest.importorskip("triton")
    index_dtype = torch.int64 if layout == "contiguous" else torch.int32  # both integer dtypes the op takes
    check_sparse("triton", sparse_inputs(layout, G, S_q, norm, kv_format=kv_format, topk_length=topk_length,
                                         index_dtype=index_dtype), num_splits=num_splits)


def test_custom_op_with_indices_traces_and_opchecks():
    pytest.importorskip("triton")
    args = sparse_inputs("paged", 4, 2, "blockwise", topk_length=True)

    def step(q, r):
        return mla_decode_with_kvcache(**{**args, "q_lat": q, "q_rope": r}, num_splits=2, backend="triton")

    out, lse = torch.compile(step, backend="eager", fullgraph=True)(args["q_lat"], args["q_rope"])
    ref, ref_lse = step(args["q_lat"], args["q_rope"])
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse, ref_lse)
    op_args = (args["q_lat"], args["q_rope"], args["kv_cache"], args["scale_cache"], args["block_table"],
               args["cache_seqlens"], 0.3, 2, False, None, "dense", args["indices"], args["topk_length"])
    torch.library.opcheck(interface._mla_decode_op, op_args, test_utils=("test_schema", "test_faketensor"))


def test_naive_is_the_dense_decode_over_the_selected_rows():
    """The spec of a sparse decode, written another way: each query's selected rows and key
    scalars, gathered with the same indices into a contiguous cache of their own, decoded densely
    (that query seeing all of them). The order of the entries does not matter, and selecting
    every slot of a sequence is the dense decode (S_q = 1)."""
    args = sparse_inputs("paged", 4, 2, "unified", topk_length=True)
    out, lse = mla_decode_with_kvcache(**args, backend="naive")
    page, table = args["kv_cache"].shape[1], args["block_table"].long()
    for b, n in enumerate(LENGTHS):
        for t in range(2):
            k = int(args["topk_length"][b])
            picked = [int(j) for j in args["indices"][b, t, :k] if 0 <= int(j) < n]
            if not picked:
                assert out[b, t].abs().max() == 0 and bool((lse[b, t] == float("-inf")).all())
                continue
            j = torch.tensor(picked, device=DEVICE)
            where = (table[b, j // page], j % page)
            one = dict(q_lat=args["q_lat"][b:b + 1, t:t + 1], q_rope=args["q_rope"][b:b + 1, t:t + 1],
                       kv_cache=args["kv_cache"][where][None], block_table=None,
                       cache_seqlens=torch.tensor([len(picked)], device=DEVICE),
                       scale_cache=args["scale_cache"][where][None], softmax_scale=args["softmax_scale"],
                       mode=args["mode"])
            want, want_lse = mla_decode_with_kvcache(**one, backend="naive")
            torch.testing.assert_close(out[b, t], want[0, 0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse[b, t], want_lse[0, 0], rtol=1e-5, atol=1e-5)
    shuffled = args["indices"][..., torch.randperm(TOPK)]
    del args["topk_length"]
    torch.testing.assert_close(mla_decode_with_kvcache(**{**args, "indices": shuffled}, backend="naive")[0],
                               mla_decode_with_kvcache(**args, backend="naive")[0], rtol=1e-5, atol=1e-5)
    dense = decode_inputs("paged", 4, 1, "blockwise", "causal")
    every = torch.arange(max(LENGTHS), device=DEVICE).expand(len(LENGTHS), 1, -1)
    torch.testing.assert_close(mla_decode_with_kvcache(**{**dense, "visible_lens": None, "indices": every},
                                                       backend="naive")[0],
                               mla_decode_with_kvcache(**dense, backend="naive")[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["naive", "torch"])
def test_entries_past_the_length_or_topk_length_select_nothing(backend):
    """An entry at or past its sequence's length (or past the capacity), any negative one, and
    one at or past topk_length[b] are masked, exactly as -1 is: FlashMLA's sparse prefill masks
    indices < 0 or >= s_kv, and reads the first topk_length entries."""
    args = sparse_inputs("paged", 4, 2, "blockwise", topk_length=True)
    lens, k = args["cache_seqlens"].long(), args["topk_length"].long()
    idx = args["indices"].long()
    outside = (idx < 0) | (idx >= lens[:, None, None]) | (torch.arange(TOPK, device=DEVICE) >= k[:, None, None])
    assert bool(((idx >= lens[:, None, None]) & (torch.arange(TOPK, device=DEVICE) < k[:, None, None])).any())
    marked = idx.masked_fill(outside, -1).int()
    want, want_lse = mla_decode_with_kvcache(**{**args, "indices": marked, "topk_length": None}, backend=backend)
    out, lse = mla_decode_with_kvcache(**args, backend=backend)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


def test_the_cpu_kernel_is_handed_each_querys_selected_slots_first_in_order():
    """What the C++ kernel reads (its own tests run where it runs): the selected entries of each
    query moved to the front, in the order listed, their count beside them."""
    from qkmla.ops.mla_decode.selection import packed_selection

    indices = torch.tensor([[[7, -1, 3, 9, 3, 40]], [[-1, -1, -1, -1, -1, -1]]])
    slots, counts = packed_selection(indices, torch.tensor([5, 6]), torch.tensor([10, 4]))
    assert counts.tolist() == [[4], [0]]  # 7, 3, 9, 3 (9 < 10; 40 past the length and topk_length)
    assert slots[0, 0, :4].tolist() == [7, 3, 9, 3] and slots.dtype == torch.int64 and slots.is_contiguous()


def test_bad_indices_are_refused_before_any_work(monkeypatch):
    """Wrong shape, dtype or device of ``indices`` / ``topk_length``, or indices with
    visible_lens: a ValueError naming the argument and the allowed values, before a backend is
    even chosen."""
    args = sparse_inputs("paged", 4, 2, "blockwise")

    def no_work(*a, **k):
        raise AssertionError("reached the backends")
    monkeypatch.setattr(interface, "resolve_backend", no_work)
    idx = args["indices"]
    allowed = r"indices: expected an int32/int64 tensor \[B=4, S_q=2, topk >= 1\] of slot positions " \
              r"\(each in \[0, cache_seqlens\[b\]\) to select it, -1 for none\), got "
    for bad, got in ((idx.float(), r"torch.float32 \(4, 2, 24\)"), (idx[:, 0], r"torch.int32 \(4, 24\)"),
                     (idx[:3], r"torch.int32 \(3, 2, 24\)"), (idx[:, :1], r"torch.int32 \(4, 1, 24\)"),
                     (idx[..., :0], r"torch.int32 \(4, 2, 0\)"), (idx.bool(), r"torch.bool \(4, 2, 24\)"),
                     (idx.tolist(), "list")):
        with pytest.raises(ValueError, match=allowed + got):
            mla_decode_with_kvcache(**{**args, "indices": bad})
    with pytest.raises(ValueError, match=r"indices: expected a tensor on q_lat's device \((cpu|cuda:0)\), got meta"):
        mla_decode_with_kvcache(**{**args, "indices": idx.to("meta")})
    with pytest.raises(ValueError, match="indices, visible_lens: .* pass one of them"):
        mla_decode_with_kvcache(**args, visible_lens=args["cache_seqlens"][:, None].expand(-1, 2))
    with pytest.raises(ValueError, match=r"topk_length: expected an int32/int64 tensor \[B=4\] of entry counts"):
        mla_decode_with_kvcache(**args, topk_length=torch.tensor([1, 2], device=DEVICE))
    with pytest.raises(ValueError, match=r"topk_length: expected an int32/int64 tensor \[B=4\].*got torch.float32"):
        mla_decode_with_kvcache(**args, topk_length=torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match="topk_length: expected a tensor on q_lat's device"):
        mla_decode_with_kvcache(**args, topk_length=torch.ones(4, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="topk_length: .* it needs indices"):
        mla_decode_with_kvcache(**{**args, "indices": None}, topk_length=torch.ones(4, dtype=torch.int32))


def test_the_spec_in_bfloat16_is_what_the_torch_backend_is_held_to():
    """bfloat16 queries and rows through the torch backend's gather: as close to the float32
    spec as the spec computed in bfloat16, give or take a factor 2 (the dense op's bound)."""
    args = sparse_inputs("paged", H, 2, "blockwise")
    ref, _ = mla_decode_with_kvcache(**args, backend="naive")
    half = {k: v.to(torch.bfloat16) if k in ("q_lat", "q_rope", "kv_cache", "scale_cache") else v
            for k, v in args.items()}
    spec_bf16, _ = naive_mla_decode(half["q_lat"], half["q_rope"], half["kv_cache"], half["block_table"],
                                    half["cache_seqlens"], half["scale_cache"], half["softmax_scale"],
                                    compute_dtype=torch.bfloat16, mode=half["mode"], indices=half["indices"])
    out, _ = mla_decode_with_kvcache(**half, backend="torch")
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    spec_err, err = (spec_bf16.float() - ref).abs().max(), (out.float() - ref).abs().max()
    assert 0 < err <= 2 * spec_err, (err, spec_err)
