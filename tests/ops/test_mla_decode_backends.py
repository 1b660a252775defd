"""Every backend of the MLA decode op against the spec, ``naive.py``, on the same cases.

Cases: paged (shuffled block table, NaN in every slot no sequence owns) and contiguous
(NaN past each length) caches; lengths 1, 97, 1025 and 0 in one batch; G in {1, 4, h};
S_q in {1, 2}; plain MLA and the key scalars of blockwise RMS, unified RMS, L2 and Lp
norms (computed from random content keys, so each norm's scalars have their own size);
causal visibility or a per-query prefix (``visible_lens``, what padded batches pass).

The torch backend runs the whole grid. The Triton backend runs in Triton's interpreter on
the CPU, so it runs a subset that still covers every value of every axis; it supports every
case of the grid (no case is left out for lack of support).
"""

import itertools

import pytest
import torch

from qkmla.norms import statistic
from qkmla.ops.mla_decode import mla_decode_with_kvcache, naive_mla_decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = (1, 97, 1025, 0)  # odd lengths and a zero-length sequence, in one batch
H, D_C, D_R, D_N = 8, 32, 16, 16
NORMS = {  # name: (qk_norm kind, p, mode, softmax_scale); None: plain MLA
    "plain": (None, 2.0, "blockwise", 0.3),
    "blockwise": ("rms", 2.0, "blockwise", 0.3),
    "unified": ("rms", 2.0, "unified", 0.3),
    "l2": ("l2", 2.0, "blockwise", 5.0),  # unit vectors have small dot products: a larger tau
    "lp": ("lp", 3.0, "blockwise", 5.0),
}


def decode_inputs(layout: str, G: int, S_q: int, norm: str, visibility: str, seed: int = 0):
    """Keyword arguments of ``mla_decode_with_kvcache`` for one case (float32)."""
    gen = torch.Generator().manual_seed(seed)
    kind, p, mode, scale = NORMS[norm]
    B, n_max = len(LENGTHS), max(LENGTHS)
    if layout == "paged":
        page = 16
        per_seq = -(-n_max // page) + 1
        n_blocks = B * per_seq + 3  # a few blocks nobody owns
        table = torch.randperm(n_blocks, generator=gen)[:B * per_seq].view(B, per_seq).to(torch.int32)
        kv = torch.full((n_blocks, page, D_C + D_R), float("nan"))
        scales = torch.full((n_blocks, page, G), float("nan"))
    else:
        table = None
        kv = torch.full((B, n_max + 5, D_C + D_R), float("nan"))
        scales = torch.full((B, n_max + 5, G), float("nan"))
    for b, n in enumerate(LENGTHS):
        slot = torch.arange(n)
        where = (table[b, slot // page].long(), slot % page) if table is not None else (b, slot)
        kv[where] = torch.randn(n, D_C + D_R, generator=gen)
        if kind is not None:  # the key scalars of content keys c W_UK, one per group
            k_c = torch.randn(n, G, D_N, generator=gen) * (0.5 + torch.rand(n, G, 1, generator=gen))
            scales[where] = statistic(k_c, kind, p).squeeze(-1)
    visible = None
    if visibility == "prefix":  # any prefix of each sequence, one value past its length included
        visible = torch.stack([torch.randint(0, n + 2, (S_q,), generator=gen) for n in LENGTHS]).to(torch.int32)
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    q_lat = torch.randn(B, S_q, H, D_C, generator=gen) * 0.3
    q_rope = torch.randn(B, S_q, H, D_R, generator=gen) * 0.3
    dev = lambda t: t.to(DEVICE) if t is not None else None  # noqa: E731
    return dict(q_lat=dev(q_lat), q_rope=dev(q_rope), kv_cache=dev(kv), block_table=dev(table),
                cache_seqlens=dev(lens), scale_cache=dev(scales) if kind is not None else None,
                softmax_scale=scale, mode=mode, visible_lens=dev(visible))


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


@pytest.mark.parametrize("mode", ["blockwise", "unified"])
def test_naive_is_the_definition(mode):
    """The spec against the formula written densely: r scales the content score (blockwise)
    or the whole logit (unified), per-query prefixes mask the rest, softmax, then @ c."""
    args = decode_inputs("contiguous", 4, 2, "blockwise", "prefix", seed=3)
    args["mode"] = mode
    out, lse = naive_mla_decode(args["q_lat"], args["q_rope"], args["kv_cache"],
                                torch.arange(len(LENGTHS))[:, None], args["cache_seqlens"], args["scale_cache"],
                                args["softmax_scale"], mode=mode, visible_lens=args["visible_lens"])
    kv, S = args["kv_cache"].nan_to_num(0.0), args["kv_cache"].shape[1]
    c, k_rope = kv[..., :D_C], kv[..., D_C:]
    r = args["scale_cache"].nan_to_num(1.0).repeat_interleave(H // 4, dim=-1).permute(0, 2, 1)[:, None]  # [B, 1, H, S]
    s_c = torch.einsum("bthc,bsc->bths", args["q_lat"], c)
    s_r = torch.einsum("bthr,bsr->bths", args["q_rope"], k_rope)
    s = args["softmax_scale"] * (r * s_c + s_r if mode == "blockwise" else r * (s_c + s_r))
    lens = args["cache_seqlens"].long()
    visible = torch.minimum(args["visible_lens"].long(), lens[:, None])  # [B, S_q]
    s = s.masked_fill(~(torch.arange(S) < visible[..., None])[:, :, None, :], float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, torch.einsum("bths,bsc->bthc", torch.softmax(s, -1).nan_to_num(0.0), c),
                               rtol=1e-5, atol=1e-5)


def test_backend_choice_and_refusals(monkeypatch):
    from qkmla.ops.mla_decode import interface, select_backend

    assert select_backend("auto", torch.device("cpu"), 512, 64) == "torch"
    assert select_backend("naive", torch.device("cpu"), 24, 8) == "naive"
    with pytest.raises(ValueError, match=r"backend: expected one of \('auto', 'naive', 'torch', 'triton'\)"):
        select_backend("cuda", torch.device("cpu"), 512, 64)
    monkeypatch.setattr(interface, "triton_installed", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend: 'triton' runs on CUDA tensors"):
        select_backend("triton", torch.device("cpu"), 512, 64)
    monkeypatch.setattr(interface, "triton_installed", lambda: False)
    with pytest.raises(ValueError, match="not installed"):
        select_backend("triton", torch.device("cuda"), 512, 64)
    assert select_backend("auto", torch.device("cuda"), 512, 64) == "torch"
    args = decode_inputs("paged", 4, 1, "blockwise", "causal")
    with pytest.raises(ValueError, match="mode: expected one of"):
        mla_decode_with_kvcache(**{**args, "mode": "joint"})
    with pytest.raises(ValueError, match="visible_lens"):
        mla_decode_with_kvcache(**{**args, "visible_lens": args["cache_seqlens"]})


@pytest.mark.parametrize("backend", ["naive", "torch"])
def test_per_head_softmax_scale_is_each_heads_logit_scale(backend):
    args = decode_inputs("paged", 4, 2, "blockwise", "causal")
    scales = torch.linspace(0.1, 0.8, H, device=DEVICE)
    out, lse = mla_decode_with_kvcache(**{**args, "softmax_scale": scales}, backend=backend)
    for h in (0, H - 1):
        want, want_lse = mla_decode_with_kvcache(**{**args, "softmax_scale": float(scales[h])}, backend=backend)
        torch.testing.assert_close(out[:, :, h], want[:, :, h], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, :, h], want_lse[:, :, h], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"softmax_scale: expected a float or a tensor \[H=8\]"):
        mla_decode_with_kvcache(**{**args, "softmax_scale": scales[:3]}, backend=backend)
