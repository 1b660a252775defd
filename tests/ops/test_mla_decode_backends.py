"""Every backend of the MLA decode op against the spec, ``naive.py``, on the same cases.

Cases: paged (shuffled block table, NaN in every slot no sequence owns) and contiguous
(NaN past each length) caches; lengths 1, 97, 1025 and 0 in one batch; G in {1, 4, h};
S_q in {1, 2}; plain MLA and the key scalars of blockwise RMS, unified RMS, L2 and Lp
norms (computed from random content keys, so each norm's scalars have their own size);
causal visibility or a per-query prefix (``visible_lens``, what padded batches pass).

The torch backend runs the whole grid. The Triton backend runs in Triton's interpreter on
the CPU, so it runs a subset that still covers every value of every axis; it supports every
case of the grid (no case is left out for lack of support).

Quantized caches (``kv_format`` fp8, int8, int4) run the same grid: rows encoded by
``qkmla.kv_formats``, 0xFF bytes (NaN in every format) in every slot no sequence owns.
"""

import itertools

import pytest
import torch

from qkmla.kv_formats import row_format
from qkmla.ops.statistic import statistic
from qkmla.ops.mla_decode import mla_decode_with_kvcache, naive_mla_decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.cuda  # inputs go to DEVICE: the GPU suite runs this file on a GPU
LENGTHS = (1, 97, 1025, 0)  # odd lengths and a zero-length sequence, in one batch
H, D_C, D_R, D_N = 8, 32, 16, 16
NORMS = {  # name: (qk_norm kind, p, mode, softmax_scale); None: plain MLA
    "plain": (None, 2.0, "blockwise", 0.3),
    "blockwise": ("rms", 2.0, "blockwise", 0.3),
    "unified": ("rms", 2.0, "unified", 0.3),
    "l2": ("l2", 2.0, "blockwise", 5.0),  # unit vectors have small dot products: a larger tau
    "lp": ("lp", 3.0, "blockwise", 5.0),
}


def decode_inputs(layout: str, G: int, S_q: int, norm: str, visibility: str, seed: int = 0,
                  kv_format: str = "dense", d_c: int = D_C):
    """Keyword arguments of ``mla_decode_with_kvcache`` for one case (float32)."""
    gen = torch.Generator().manual_seed(seed)
    kind, p, mode, scale = NORMS[norm]
    B, n_max = len(LENGTHS), max(LENGTHS)
    rows = row_format(kv_format, d_c, D_R)
    dtype, nan = (torch.float32, float("nan")) if kv_format == "dense" else (torch.uint8, 0xFF)
    if layout == "paged":
        page = 16
        per_seq = -(-n_max // page) + 1
        n_blocks = B * per_seq + 3  # a few blocks nobody owns
        table = torch.randperm(n_blocks, generator=gen)[:B * per_seq].view(B, per_seq).to(torch.int32)
        kv = torch.full((n_blocks, page, rows.width), nan, dtype=dtype)
        scales = torch.full((n_blocks, page, G), float("nan"))
    else:
        table = None
        kv = torch.full((B, n_max + 5, rows.width), nan, dtype=dtype)
        scales = torch.full((B, n_max + 5, G), float("nan"))
    for b, n in enumerate(LENGTHS):
        slot = torch.arange(n)
        where = (table[b, slot // page].long(), slot % page) if table is not None else (b, slot)
        values = torch.randn(n, d_c + D_R, generator=gen)
        kv[where] = rows.encode(values[:, :d_c], values[:, d_c:])
        if kind is not None:  # the key scalars of content keys c W_UK, one per group
            k_c = torch.randn(n, G, D_N, generator=gen) * (0.5 + torch.rand(n, G, 1, generator=gen))
            scales[where] = statistic(k_c, kind, p).squeeze(-1)
    visible = None
    if visibility == "prefix":  # any prefix of each sequence, one value past its length included
        visible = torch.stack([torch.randint(0, n + 2, (S_q,), generator=gen) for n in LENGTHS]).to(torch.int32)
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    q_lat = torch.randn(B, S_q, H, d_c, generator=gen) * 0.3
    q_rope = torch.randn(B, S_q, H, D_R, generator=gen) * 0.3
    dev = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    return dict(q_lat=dev(q_lat), q_rope=dev(q_rope), kv_cache=dev(kv), block_table=dev(table),
                cache_seqlens=dev(lens), scale_cache=dev(scales) if kind is not None else None,
                softmax_scale=scale, mode=mode, visible_lens=dev(visible), kv_format=kv_format)


def check_against_naive(backend: str, args: dict) -> None:
    ref, ref_lse = mla_decode_with_kvcache(**args, backend="naive")
    out, lse = mla_decode_with_kvcache(**args, backend=backend)
    assert out.dtype == args["q_lat"].dtype and lse.dtype == torch.float32
    assert not torch.isnan(out).any()  # no stray read of a NaN slot
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)  # -inf exactly where no slot is visible
    torch.testing.assert_close(lse[seen], ref_lse[seen], rtol=1e-4, atol=1e-4)
    assert out[~seen].abs().max() == 0 if (~seen).any() else True


AXES = dict(layout=["paged", "contiguous"], G=[1, 4, H], S_q=[1, 2], norm=list(NORMS), visibility=["causal", "prefix"])
GRID = list(itertools.product(*AXES.values()))


def case_id(case) -> str:
    layout, G, S_q, norm, visibility = case
    return f"{layout}-G{G}-Sq{S_q}-{norm}-{visibility}"


@pytest.mark.parametrize("layout,G,S_q,norm,visibility", GRID, ids=[case_id(c) for c in GRID])
def test_torch_backend_matches_naive(layout, G, S_q, norm, visibility):
    check_against_naive("torch", decode_inputs(layout, G, S_q, norm, visibility))


# The paged torch backend reads a chunk of blocks at a time and folds each into a running
# softmax; a chunk holds about SCORE_CHUNK keys over the batch, so at its default the grid above
# takes two chunks. Here it holds 3 blocks per sequence (48 keys each, 192 over the batch of
# 4): 1025 slots take 22 chunks, the last one partly past the length.
CHUNKED = [("paged", G, S_q, norm, visibility) for G, S_q, norm, visibility in
           [(1, 1, "plain", "causal"), (4, 2, "blockwise", "prefix"), (H, 1, "blockwise", "causal"),
            (H, 2, "unified", "prefix"), (4, 1, "lp", "causal")]]


@pytest.mark.parametrize("layout,G,S_q,norm,visibility", CHUNKED, ids=[case_id(c) for c in CHUNKED])
def test_torch_backend_over_many_chunks_matches_naive(monkeypatch, layout, G, S_q, norm, visibility):
    from qkmla.ops.mla_decode import torch_impl

    monkeypatch.setattr(torch_impl, "SCORE_CHUNK", 48 * len(LENGTHS))
    check_against_naive("torch", decode_inputs(layout, G, S_q, norm, visibility))
    monkeypatch.setattr(torch_impl, "SCORE_CHUNK", 40 * len(LENGTHS))  # not a whole number of blocks: 2
    check_against_naive("torch", decode_inputs(layout, G, S_q, norm, visibility, kv_format="int8"))


@pytest.mark.parametrize("chunk", [4096, 96])  # one chunk; two blocks per sequence in each
def test_paged_sequences_of_one_length_ending_inside_a_block(monkeypatch, chunk):
    """Every sequence 37 slots long in blocks of 16: no query needs a mask, yet the last block
    is read whole; its 11 unfilled slots (NaN here) must not enter the softmax."""
    from qkmla.ops.mla_decode import torch_impl

    monkeypatch.setattr(torch_impl, "SCORE_CHUNK", chunk)
    monkeypatch.setitem(globals(), "LENGTHS", (37, 37, 37))
    for norm in ("plain", "blockwise"):
        check_against_naive("torch", decode_inputs("paged", H, 1, norm, "causal"))


@pytest.mark.parametrize("spacing", ["row", "padded-row", "padded-block"])
@pytest.mark.parametrize("norm", ["plain", "blockwise"])
def test_paged_views_of_one_wide_row_read_as_separate_caches(monkeypatch, spacing, norm):
    """vLLM's layout: one row [c | k_rope | r] per slot, the op given column views of it
    (``cache[..., :d_c + d_r]``, ``cache[..., d_c + d_r:]``); rows padded before and after the
    scalars; and blocks padded past their last slot ([n, 20, width][:, :16]). All read a block
    of column slices at a time, and equal the same rows held in two contiguous caches, exactly."""
    from qkmla.ops.mla_decode import torch_impl

    monkeypatch.setattr(torch_impl, "SCORE_CHUNK", 48 * len(LENGTHS))  # several chunks
    args = decode_inputs("paged", 4, 2, norm, "prefix")
    kv, scales = args["kv_cache"], args["scale_cache"]
    G = 0 if scales is None else scales.shape[-1]
    n_blocks, page, width = kv.shape
    gap, tail, extra_slots = {"row": (0, 0, 0), "padded-row": (3, 5, 0), "padded-block": (0, 0, 4)}[spacing]
    wide = torch.full((n_blocks, page + extra_slots, width + gap + G + tail), float("nan"),
                      device=kv.device)[:, :page]
    wide[..., :width] = kv
    if G:
        wide[..., width + gap:width + gap + G] = scales
    views = dict(kv_cache=wide[..., :width], scale_cache=wide[..., width + gap:width + gap + G] if G else None)
    want = mla_decode_with_kvcache(**args, backend="torch")
    got = mla_decode_with_kvcache(**{**args, **views}, backend="torch")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_float32_queries_read_a_bfloat16_cache_in_float32(monkeypatch, layout):
    """A bfloat16 cache (vLLM's rows, a LatentCache's) serves float32 queries: its rows are read
    in the queries' dtype, so the answer is the float32 spec on the cached bfloat16 values."""
    from qkmla.ops.mla_decode import torch_impl

    monkeypatch.setattr(torch_impl, "SCORE_CHUNK", 48 * len(LENGTHS))
    args = decode_inputs(layout, 4, 1, "blockwise", "causal")
    check_against_naive("torch", {**args, "kv_cache": args["kv_cache"].to(torch.bfloat16)})


@pytest.mark.parametrize("norm, rows", [("plain", "apart"), ("blockwise", "apart"), ("unified", "apart"),
                                        ("blockwise", "one-row"), ("unified", "one-row")])
def test_torch_backend_in_bfloat16_stays_within_bf16s_roundoff(monkeypatch, norm, rows):
    """bfloat16 queries and cache through the paged torch backend (two half-precision GEMMs
    per chunk, joined in float32), many chunks: as close to
    the float32 spec as the spec computed in bfloat16 is, give or take a factor 2. The
    scalars in a cache of their own, or in vLLM's row [c | k_rope | r] (column views of one row)."""
    from qkmla.ops.mla_decode import torch_impl

    monkeypatch.setattr(torch_impl, "SCORE_CHUNK", 48 * len(LENGTHS))
    args = decode_inputs("paged", H, 1, norm, "causal")
    ref, _ = mla_decode_with_kvcache(**args, backend="naive")
    half = {k: (v.to(torch.bfloat16) if k in ("q_lat", "q_rope", "kv_cache", "scale_cache") and v is not None
                else v) for k, v in args.items()}
    if rows == "one-row":
        wide = torch.cat((half["kv_cache"], half["scale_cache"]), dim=-1)
        width = half["kv_cache"].shape[-1]
        half.update(kv_cache=wide[..., :width], scale_cache=wide[..., width:])
    spec_bf16, _ = naive_mla_decode(half["q_lat"], half["q_rope"], half["kv_cache"], half["block_table"],
                                    half["cache_seqlens"], half["scale_cache"], half["softmax_scale"],
                                    compute_dtype=torch.bfloat16, mode=half["mode"])
    out, _ = mla_decode_with_kvcache(**half, backend="torch")
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    spec_err = (spec_bf16.float() - ref).abs().max()
    err = (out.float() - ref).abs().max()
    assert 0 < err <= 2 * spec_err, (err, spec_err)


# Every value of every axis at least once, in few interpreter runs.
TRITON_CASES = [
    ("paged", 1, 1, "plain", "causal"), ("paged", 4, 2, "blockwise", "causal"), ("paged", H, 2, "unified", "prefix"),
    ("paged", 4, 1, "l2", "prefix"), ("paged", H, 1, "lp", "causal"), ("contiguous", 1, 2, "blockwise", "prefix"),
    ("contiguous", 4, 1, "unified", "causal"), ("contiguous", H, 2, "plain", "prefix"),
]


@pytest.mark.parametrize("layout,G,S_q,norm,visibility", TRITON_CASES, ids=[case_id(c) for c in TRITON_CASES])
def test_triton_backend_matches_naive(layout, G, S_q, norm, visibility):
    pytest.importorskip("triton")
    check_against_naive("triton", decode_inputs(layout, G, S_q, norm, visibility))


QUANT_GRID = [(kv_format, *case) for kv_format in ("fp8", "int8", "int4") for case in GRID]


@pytest.mark.parametrize("kv_format,layout,G,S_q,norm,visibility", QUANT_GRID,
                         ids=[f"{c[0]}-{case_id(c[1:])}" for c in QUANT_GRID])
def test_torch_backend_reads_quantized_caches_as_naive_does(kv_format, layout, G, S_q, norm, visibility):
    check_against_naive("torch", decode_inputs(layout, G, S_q, norm, visibility, kv_format=kv_format))


# Every format, and every value of every axis under a quantized format, in few interpreter runs;
# d_c = 256 spans two fp8 tiles and eight int4 groups (the others: one fp8 tile of 32 values).
TRITON_QUANT_CASES = [
    ("fp8", "paged", 4, 2, "blockwise", "prefix", D_C), ("fp8", "contiguous", H, 1, "unified", "causal", D_C),
    ("int8", "paged", 1, 1, "plain", "causal", D_C), ("int8", "contiguous", 4, 2, "l2", "prefix", D_C),
    ("int4", "paged", H, 2, "lp", "causal", D_C), ("int4", "contiguous", 1, 1, "blockwise", "prefix", D_C),
    ("fp8", "paged", 4, 1, "blockwise", "causal", 256), ("int4", "paged", 4, 1, "unified", "causal", 256),
]


@pytest.mark.parametrize("kv_format,layout,G,S_q,norm,visibility,d_c", TRITON_QUANT_CASES,
                         ids=[f"{c[0]}-{case_id(c[1:6])}-dc{c[6]}" for c in TRITON_QUANT_CASES])
def test_triton_backend_reads_quantized_caches_as_naive_does(kv_format, layout, G, S_q, norm, visibility, d_c):
    pytest.importorskip("triton")
    check_against_naive("triton", decode_inputs(layout, G, S_q, norm, visibility, kv_format=kv_format, d_c=d_c))


def test_naive_dequantizes_each_row_as_the_format_defines():
    """The spec over a quantized cache is the spec over the dequantized rows in a dense cache."""
    args = decode_inputs("paged", 4, 2, "blockwise", "prefix", kv_format="fp8")
    out, lse = mla_decode_with_kvcache(**args, backend="naive")
    dense = row_format("fp8", D_C, D_R).decode(args["kv_cache"])  # NaN where the bytes are 0xFF
    want, want_lse = mla_decode_with_kvcache(**{**args, "kv_cache": dense, "kv_format": "dense"}, backend="naive")
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert torch.isnan(dense).any()  # the unused slots really are poisoned


@pytest.mark.parametrize("mode", ["blockwise", "unified"])
def test_naive_is_the_definition(mode):
    """The spec against the formula written densely: r scales the content score (blockwise)
    or the whole logit (unified), per-query prefixes mask the rest, softmax, then @ c."""
    args = decode_inputs("contiguous", 4, 2, "blockwise", "prefix", seed=3)
    args["mode"] = mode
    table = torch.arange(len(LENGTHS), device=DEVICE)[:, None]  # one block per sequence
    out, lse = naive_mla_decode(args["q_lat"], args["q_rope"], args["kv_cache"], table, args["cache_seqlens"],
                                args["scale_cache"], args["softmax_scale"], mode=mode,
                                visible_lens=args["visible_lens"])
    kv, S = args["kv_cache"].nan_to_num(0.0), args["kv_cache"].shape[1]
    c, k_rope = kv[..., :D_C], kv[..., D_C:]
    r = args["scale_cache"].nan_to_num(1.0).repeat_interleave(H // 4, dim=-1).permute(0, 2, 1)[:, None]  # [B, 1, H, S]
    s_c = torch.einsum("bthc,bsc->bths", args["q_lat"], c)
    s_r = torch.einsum("bthr,bsr->bths", args["q_rope"], k_rope)
    s = args["softmax_scale"] * (r * s_c + s_r if mode == "blockwise" else r * (s_c + s_r))
    lens = args["cache_seqlens"].long()
    visible = torch.minimum(args["visible_lens"].long(), lens[:, None])  # [B, S_q]
    s = s.masked_fill(~(torch.arange(S, device=DEVICE) < visible[..., None])[:, :, None, :], float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, torch.einsum("bths,bsc->bthc", torch.softmax(s, -1).nan_to_num(0.0), c),
                               rtol=1e-5, atol=1e-5)


def test_backend_choice_and_refusals(monkeypatch):
    from qkmla.ops.mla_decode import backends, select_backend

    assert select_backend("auto", torch.device("cpu"), 512, 64) == "torch"
    assert select_backend("naive", torch.device("cpu"), 24, 8) == "naive"
    with pytest.raises(ValueError, match=r"backend: expected one of \('auto', 'naive', 'torch', 'cpu', 'triton'\)"):
        select_backend("cuda", torch.device("cpu"), 512, 64)
    monkeypatch.setattr(backends, "triton_installed", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend: 'triton' runs on CUDA tensors"):
        select_backend("triton", torch.device("cpu"), 512, 64)
    monkeypatch.setattr(backends, "triton_installed", lambda: False)
    with pytest.raises(ValueError, match="not installed"):
        select_backend("triton", torch.device("cuda"), 512, 64)
    assert select_backend("auto", torch.device("cuda"), 512, 64) == "torch"
    args = decode_inputs("paged", 4, 1, "blockwise", "causal")
    with pytest.raises(ValueError, match="mode: expected one of"):
        mla_decode_with_kvcache(**{**args, "mode": "joint"})
    with pytest.raises(ValueError, match="visible_lens"):
        mla_decode_with_kvcache(**{**args, "visible_lens": args["cache_seqlens"]})


def test_quantized_cache_refusals():
    """Unknown formats and rows of another width or dtype: ValueErrors naming the argument
    and the allowed values, before any backend runs."""
    args = decode_inputs("paged", 4, 1, "blockwise", "causal", kv_format="int4")
    with pytest.raises(ValueError, match=r"kv_format: expected one of \('dense', 'fp8', 'int8', 'int4'\), got 'nf4'"):
        mla_decode_with_kvcache(**{**args, "kv_format": "nf4"})
    with pytest.raises(ValueError, match=r"kv_cache: expected \[num_blocks, block_size, the fp8 row's bytes = 68\]"):
        mla_decode_with_kvcache(**{**args, "kv_format": "fp8"})  # int4 rows are 52 bytes at d_c 32, d_r 16
    with pytest.raises(ValueError, match="kv_cache: kv_format='int4' rows are uint8 bytes, got torch.float32"):
        mla_decode_with_kvcache(**{**args, "kv_cache": args["kv_cache"].float()})


@pytest.mark.parametrize("backend", ["naive", "torch"])
def test_per_head_softmax_scale_is_each_heads_logit_scale(backend):
    args = decode_inputs("paged", 4, 2, "blockwise", "causal")
    scales = torch.linspace(0.1, 0.8, H, device=DEVICE)
    out, lse = mla_decode_with_kvcache(**{**args, "softmax_scale": scales}, backend=backend)
    for h in (0, H - 1):
        want, want_lse = mla_decode_with_kvcache(**{**args, "softmax_scale": float(scales[h])}, backend=backend)
        torch.testing.assert_close(out[:, :, h], want[:, :, h], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, :, h], want_lse[:, :, h], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"softmax_scale: expected a float or a floating-point tensor \[H=8\]"):
        mla_decode_with_kvcache(**{**args, "softmax_scale": scales[:3]}, backend=backend)


def test_byte_rows_passed_as_dense_are_refused():
    """int4 rows at d_c 64, d_r 24 are 88 bytes, as wide as a dense row: the dtype tells them apart."""
    from qkmla.kv_formats import row_format

    d_c, d_r = 64, 24
    assert row_format("int4", d_c, d_r).width == d_c + d_r
    q_lat, q_rope = torch.randn(1, 1, 2, d_c), torch.randn(1, 1, 2, d_r)
    rows = torch.zeros(1, 4, d_c + d_r, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_cache: kv_format='dense' rows are floating-point values, got torch.uint8"):
        mla_decode_with_kvcache(q_lat, q_rope, rows, None, torch.tensor([4]), softmax_scale=0.3, backend="torch")


@pytest.mark.parametrize("backend", ["naive", "torch", "auto"])
def test_the_softmax_scale_has_no_default(backend):
    """Issue 52, point 9: an omitted scale was 1.0, unscaled logits without a word. It is a
    required keyword (FlashMLA's callers name it too); None, a bool or a string is refused by name."""
    args = decode_inputs("paged", 4, 1, "blockwise", "causal")
    scale = args.pop("softmax_scale")
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'softmax_scale'"):
        mla_decode_with_kvcache(**args, backend=backend)
    for bad in (None, True, "0.3"):
        with pytest.raises(ValueError, match=r"softmax_scale: expected the logit scale \(a finite float > 0, or a tensor "
                                             rf"\[H\]\), e\.g\. MLAConfig\.scale; got {bad!r}"):
            mla_decode_with_kvcache(**args, softmax_scale=bad, backend=backend)
    with pytest.raises(TypeError, match="positional"):  # the scale is named at every call
        mla_decode_with_kvcache(*(args.pop(k) for k in ("q_lat", "q_rope", "kv_cache", "block_table", "cache_seqlens",
                                                        "scale_cache")), scale, **args, backend=backend)
