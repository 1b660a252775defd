"""Public MLA decode op: validation, the ``torch.library`` custom op and backend choice.

``qkmla::mla_decode`` is a custom op with a fake (meta) implementation, so it traces under
``torch.compile`` and can be captured in CUDA graphs. Its number of splits is a static
argument, so a captured graph never syncs with the host.
"""

from __future__ import annotations

from typing import Optional

import torch

from .naive import naive_mla_decode

BACKENDS = ("auto", "triton", "naive")


@torch.library.custom_op("qkmla::mla_decode", mutates_args=())
def _mla_decode_op(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, scale_cache: Optional[torch.Tensor],
                   block_table: torch.Tensor, cache_seqlens: torch.Tensor, softmax_scale: float,
                   num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_kernel import mla_decode_fwd  # Triton is imported only when the kernel runs

    return mla_decode_fwd(q_lat, q_rope, kv_cache, scale_cache, block_table, cache_seqlens, softmax_scale, num_splits)


@_mla_decode_op.register_fake
def _(q_lat, q_rope, kv_cache, scale_cache, block_table, cache_seqlens, softmax_scale, num_splits):
    B, S_q, H, _ = q_lat.shape
    return torch.empty_like(q_lat), q_lat.new_empty((B, S_q, H), dtype=torch.float32)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def check_inputs(q_lat, q_rope, kv_cache, block_table, cache_seqlens, scale_cache) -> None:
    """ValueErrors naming the argument, before anything reaches a kernel."""
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("kv_cache", kv_cache), ("block_table", block_table),
                    ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if q_lat.dim() != 4 or q_rope.dim() != 4 or q_lat.shape[:3] != q_rope.shape[:3]:
        raise ValueError(f"q_lat, q_rope: expected [B, S_q, H, d_c] and [B, S_q, H, d_r], got "
                         f"{tuple(q_lat.shape)} and {tuple(q_rope.shape)}")
    B, S_q, H, d_c = q_lat.shape
    d_r = q_rope.shape[-1]
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != d_c + d_r:
        raise ValueError(f"kv_cache: expected [num_blocks, block_size, d_c + d_r = {d_c + d_r}], got {tuple(kv_cache.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table: expected an int32/int64 tensor [B={B}, max_blocks], got "
                         f"{block_table.dtype} {tuple(block_table.shape)}")
    if cache_seqlens.shape != (B,) or cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cache_seqlens: expected an int32/int64 tensor [B={B}], got "
                         f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}")
    if scale_cache is not None:
        if scale_cache.dim() != 3 or scale_cache.shape[:2] != kv_cache.shape[:2] or H % scale_cache.shape[-1]:
            raise ValueError(f"scale_cache: expected [num_blocks, block_size, G] with G dividing H={H}, got "
                             f"{tuple(scale_cache.shape)}")
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("kv_cache", kv_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dimension must be contiguous")


def mla_decode_with_kvcache(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                            block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                            scale_cache: Optional[torch.Tensor] = None, softmax_scale: float = 1.0,
                            num_splits: int = 0, backend: str = "auto"):
    """Absorbed MLA decode attention over a paged latent cache, with optional key scalars.

    Args:
        q_lat: [B, S_q, H, d_c], latent queries with the query's inverse RMS and both norm
            weights folded in.
        q_rope: [B, S_q, H, d_r], normalized, rotated RoPE queries.
        kv_cache: [num_blocks, block_size, d_c + d_r], rows [c ; k_rope] (bf16/fp16/fp32).
        block_table: [B, max_blocks] int32/int64.
        cache_seqlens: [B], tokens in each sequence, the S_q new ones included.
        scale_cache: [num_blocks, block_size, G] key scalars r, or None for plain MLA.
        softmax_scale: logit scale.
        num_splits: split-K factor; 0 picks one that fills the GPU.
        backend: "triton", "naive" (the float32 reference) or "auto" (Triton on CUDA).

    Returns:
        out [B, S_q, H, d_c] (q_lat's dtype) = softmax(s) @ c per head, and lse [B, S_q, H]
        (float32; -inf with out = 0 where no key is visible). Query t sees the first
        seqlen - S_q + t + 1 keys. The layouts are drawn in ``naive.py``.

    Examples:
        >>> out, lse = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales, 0.07)  # doctest: +SKIP
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    check_inputs(q_lat, q_rope, kv_cache, block_table, cache_seqlens, scale_cache)
    if backend == "auto":
        backend = "triton" if q_lat.is_cuda else "naive"
    if backend == "naive":
        out, lse = naive_mla_decode(q_lat, q_rope, kv_cache, block_table, cache_seqlens, scale_cache, softmax_scale)
        return out.to(q_lat.dtype), lse
    d_c, d_r = q_lat.shape[-1], q_rope.shape[-1]
    if not (_is_pow2(d_c) and _is_pow2(d_r) and d_c >= 16 and d_r >= 16):
        raise ValueError(f"q_lat, q_rope: the Triton kernel needs d_c and d_r powers of two >= 16, got {d_c}, {d_r}")
    return _mla_decode_op(q_lat, q_rope, kv_cache, scale_cache, block_table, cache_seqlens, float(softmax_scale),
                          int(num_splits))
