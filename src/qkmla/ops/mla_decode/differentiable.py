"""The torch backend's path when autograd records through the op: plain out-of-place tensor ops.

The torch backend's fast paths (``torch_impl.py``) run the softmax in place and write into kept
buffers, which autograd cannot differentiate: a decode with gradients on (an MLA layer's decode step
in training mode, or the op called on queries that require grad) computed its output and then failed
in ``backward()`` with "one of the variables needed for gradient computation has been modified by an
inplace operation". The CPU kernel refuses to record (it says so and "auto" picks "torch"), so this
is where such a call lands. It reads every slot it attends to as dense rows, [B, S, width] (a paged
cache's blocks gathered through its table, a quantized row dequantized; bytes carry no gradient),
and follows the specification of ``naive.py``: the same visibility rule, the same sparse selection
(an entry listed twice counts twice), lse = -inf and out = 0 where nothing is visible.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...kv_formats import DenseRows
from .naive import default_visible_lens, selected_slots


def recording(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd records through a call over these tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _dense(kv_cache: torch.Tensor, block_table: Optional[torch.Tensor], S: int) -> torch.Tensor:
    """The first S slots of every sequence, [B, S, width]."""
    if block_table is None:
        return kv_cache[:, :S]
    blocks = -(-S // kv_cache.shape[1])
    return kv_cache[block_table[:, :blocks].long()].flatten(1, 2)[:, :S]


def differentiable_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                          block_table: Optional[torch.Tensor], cache_seqlens: torch.Tensor,
                          scale_cache: Optional[torch.Tensor], softmax_scale: float, mode: str,
                          visible_lens: Optional[torch.Tensor], S: int, rows: DenseRows,
                          indices: Optional[torch.Tensor] = None,
                          topk_length: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, h, d_c] in q_lat's dtype, lse [B, T, h] float32, float64 for float64 queries), arguments as
    ``torch_mla_decode``'s (checked), S the longest length."""
    B, T, h, d_c = q_lat.shape
    acc = torch.promote_types(q_lat.dtype, torch.float32)
    latent = rows.decode(_dense(kv_cache, block_table, S)).to(acc)  # [B, S, d_c + d_r]
    scales = _dense(scale_cache, block_table, S).to(acc) if scale_cache is not None else None
    lengths = cache_seqlens.long()
    if indices is not None:  # each query's own rows: [B, T, k, ...], invalid entries masked below
        slots, visible = selected_slots(indices, topk_length, cache_seqlens)
        slots = slots.clamp(0, max(S - 1, 0))
        pick = torch.arange(B, device=q_lat.device)[:, None, None]
        latent, scales = latent[pick, slots], scales[pick, slots] if scales is not None else None
    else:  # every query reads all S slots: [B, 1, S, ...], broadcast over T
        seen = default_visible_lens(cache_seqlens, T) if visible_lens is None else visible_lens.long()
        seen = torch.minimum(seen, lengths[:, None])
        visible = torch.arange(S, device=q_lat.device) < seen[..., None]  # [B, T, S]
        latent, scales = latent[:, None], scales[:, None] if scales is not None else None
    # Rows no query sees may hold anything (a fill of NaN, stale rows, 0xFF bytes read as NaN), and a softmax
    # weight of 0 times NaN is still NaN: zeroed, as the fast paths zero the slots past a sequence's length.
    unseen = ~visible if indices is not None else (torch.arange(S, device=q_lat.device) >= lengths[:, None])[:, None]
    latent = latent.masked_fill(unseen[..., None], 0)
    scales = scales.masked_fill(unseen[..., None], 0) if scales is not None else None
    c, k_rope = latent[..., :d_c], latent[..., d_c:]
    q_c, q_r = q_lat.to(acc) * softmax_scale, q_rope.to(acc) * softmax_scale
    content = torch.einsum("bthd,btkd->bthk", q_c, c.expand(B, T, *c.shape[2:]))
    rope = torch.einsum("bthd,btkd->bthk", q_r, k_rope.expand(B, T, *k_rope.shape[2:]))
    if scales is not None:  # head i reads its KV group's scalar, i // (h / G)
        G = scales.shape[-1]
        r = scales.expand(B, T, *scales.shape[2:]).repeat_interleave(h // G, dim=-1).transpose(-1, -2)
        s = r * (content + rope) if mode == "unified" else r * content + rope
    else:
        s = content + rope
    s = s.masked_fill(~visible[:, :, None, :], float("-inf"))  # [B, T, h, k]
    m = s.amax(dim=-1, keepdim=True).detach().clamp_min(torch.finfo(acc).min)  # a shift: no gradient
    p = torch.exp(s - m)
    row_sum = p.sum(dim=-1)
    out = torch.einsum("bthk,btkd->bthd", p, c.expand(B, T, *c.shape[2:])) / row_sum.clamp_min(1e-30)[..., None]
    lse = m.squeeze(-1) + torch.log(row_sum)  # -inf where nothing is visible, and out = 0 there (p = 0)
    return out.to(q_lat.dtype), lse  # acc: float64 for float64 queries
