"""The specification of the MLA decode op, as a readable float32 loop.

Every backend (``torch_impl.py``, ``triton_kernel.py``) is tested against this file.

Paged latent cache (FlashMLA layout) plus a paged scalar cache:

    kv_cache     [num_blocks, block_size, d_c + d_r]   rows [c ; k_rope]
    scale_cache  [num_blocks, block_size, G]           key scalars r (None: plain MLA)
    block_table  [B, max_blocks]                       slot j of sequence b lives in block
                                                       block_table[b, j // block_size], row j % block_size;
                                                       entries past ceil(seqlen / block_size) are never
                                                       read (vLLM and FlashMLA pad them with -1 or 0)
    cache_seqlens [B]                                  slots filled, the S_q new tokens included

A contiguous cache [B, capacity, d] is the same thing with one block per sequence.

Quantized rows (``kv_format`` "fp8", "int8", "int4"; ``qkmla.kv_formats``): kv_cache is
uint8 [num_blocks, block_size, row_bytes], one byte row per slot, dequantized here before
anything else (the other backends do it per chunk or per tile):

    byte 0          code_bytes         scale_offset               rope_offset        row_bytes
    | codes of c    | pad | float32 scales, one per group | pad | k_rope bfloat16 x d_r | pad |

    fp8:  codes float8_e4m3fn x d_c, a scale per 128 values    (d_c 512, d_r 64: 656 bytes, FlashMLA)
    int8: codes int8 x d_c,          one scale per token
    int4: codes in [-7, 7] + 8, two per byte (value 2i low nibble), a scale per 32 values

    c[i] = code[i] * scale[i // group]          (float32; the last group may be shorter)

Visibility. By default query t of S_q (the last S_q tokens of the sequence) sees slots
j < seqlen - S_q + t + 1, causal among the new tokens:

    slots:    0 1 2 ... n-3 n-2 n-1          (n = seqlen, S_q = 2)
    query 0:  x x x ...  x   x   .
    query 1:  x x x ...  x   x   x

``visible_lens`` [B, S_q] replaces that rule: query t of sequence b sees slots
j < min(visible_lens[b, t], seqlen). A right-padded batch uses it (a padding query sees
what the last real one sees; its output is not used), and so can any per-query prefix.

Sparse (top-k) decode. ``indices`` [B, S_q, topk] replaces both rules: query t of sequence b
sees exactly the slots listed in indices[b, t] (an indexer's top-k, as DeepSeek-V3.2's lightning
indexer picks them), in any order, and nothing else; the key scalars r are read with the same
indices as the rows. An entry selects nothing when it is -1 (FlashMLA's marker for "none") or
any other position outside [0, seqlen) (masked, as FlashMLA's sparse prefill masks indices < 0
or >= s_kv: a slot past the length holds no token yet), or when it lies at or past
``topk_length[b]`` (entries k < topk_length[b] are read, FlashMLA's ``topk_length``). A slot
listed twice counts twice. The positions are logical slots of the sequence, read through the
block table like every other slot (FlashMLA's sparse decode takes physical positions in the
block pool instead, block * block_size + offset, and no block table):

    indices[b, t] = [   5,  -1, 0,  97,  2 ]   topk_length[b] = 4, seqlen = 97
    query t sees:       5        0              (-1: none; 97 >= seqlen: none; 2: past topk_length)

No causal rule is applied on top (FlashMLA's sparse decode refuses ``causal``): the indexer's
top-k is already causal. A query that selects nothing gets out = 0 and lse = -inf, as a query
that sees no slot in the dense op (FlashMLA returns lse = +inf there; -inf is the log-sum-exp
of no logits, and merges with another partial result's lse without changing it).

For head h in group g = h // (H / G), over the visible (or selected) slots j:

    blockwise: s_j = scale * (r[j, g] * (q_lat . c_j) + q_rope . k_rope_j)     (r = 1 without scales)
    unified:   s_j = scale * r[j, g] * (q_lat . c_j + q_rope . k_rope_j)
    out = softmax(s) @ c          (latent output; W_UV is applied afterwards)
    lse = logsumexp(s)            (-inf, with out = 0, when no slot is visible)
"""

from __future__ import annotations

from typing import Optional

import torch

from ...dtypes import accumulate_dtype
from ...kv_formats import row_format


def default_visible_lens(cache_seqlens: torch.Tensor, S_q: int) -> torch.Tensor:
    """[B, S_q]: query t sees seqlen - S_q + t + 1 slots (causal among the new tokens), at least 0."""
    t = torch.arange(S_q, device=cache_seqlens.device)
    return (cache_seqlens.long()[:, None] - S_q + 1 + t).clamp_min(0)


def selected_slots(indices: torch.Tensor, topk_length: Optional[torch.Tensor],
                   cache_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, selected), both [B, S_q, topk]: the entries of ``indices`` that select a slot
    (``selected``: in [0, seqlen) and before ``topk_length[b]``, see above) and the slots as int64,
    0 where nothing is selected (a position safe to read, whose row the caller then ignores)."""
    B, S_q, topk = indices.shape
    slots = indices.long()
    selected = (slots >= 0) & (slots < cache_seqlens.long()[:, None, None])
    if topk_length is not None:
        selected &= torch.arange(topk, device=indices.device) < topk_length.long()[:, None, None]
    return slots.masked_fill(~selected, 0), selected


def naive_mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, scale_cache: Optional[torch.Tensor] = None,
                     softmax_scale: float = 1.0, compute_dtype: torch.dtype = torch.float32, *,
                     mode: str = "blockwise", visible_lens: Optional[torch.Tensor] = None,
                     kv_format="dense", indices: Optional[torch.Tensor] = None,
                     topk_length: Optional[torch.Tensor] = None):
    """Returns (out [B, S_q, H, d_c] in ``compute_dtype``, lse [B, S_q, H] float32, or float64 with a float64
    ``compute_dtype``: the softmax of float64 scores rounded to float32 was 2e-7 off the float64 reference).

    ``compute_dtype=torch.bfloat16`` gives "a plain bf16 PyTorch implementation", the
    baseline of the kernel's error budget. ``mode`` is "blockwise" or "unified" (see above).
    ``kv_format``: how kv_cache's rows are stored (see above): a name, or its row format object.
    ``indices`` [B, S_q, topk] and ``topk_length`` [B]: a sparse decode (see above); ``visible_lens``
    is then not used.
    """
    B, S_q, H, d_c = q_lat.shape
    rows_format = row_format(kv_format, d_c, q_rope.shape[-1])
    capacity = block_table.shape[1] * kv_cache.shape[1]
    if bool((cache_seqlens < 0).any()) or bool((cache_seqlens > capacity).any()):
        raise ValueError(f"cache_seqlens: expected lengths in [0, {capacity}] (the cache's capacity), got "
                         f"{cache_seqlens.tolist()}")
    G = scale_cache.shape[-1] if scale_cache is not None else 1
    page = kv_cache.shape[1]
    if visible_lens is None:
        visible_lens = default_visible_lens(cache_seqlens, S_q)
    if indices is not None:
        slots, selected = selected_slots(indices, topk_length, cache_seqlens)
    out = torch.zeros(B, S_q, H, d_c, dtype=compute_dtype, device=q_lat.device)
    score_dtype = accumulate_dtype(compute_dtype)  # torch_impl.lse_dtype's rule, on the dtype scores come from
    lse = torch.full((B, S_q, H), float("-inf"), dtype=score_dtype, device=q_lat.device)
    for b in range(B):
        n = int(cache_seqlens[b])
        slot = torch.arange(n, device=q_lat.device)
        blocks = block_table[b, slot // page].long()
        if bool((blocks < 0).any()) or bool((blocks >= kv_cache.shape[0]).any()):
            raise ValueError(f"block_table: sequence {b} reads block ids outside [0, num_blocks={kv_cache.shape[0]})")
        rows = rows_format.decode(kv_cache[blocks, slot % page]).to(compute_dtype)  # [n, d_c + d_r], dequantized
        c, k_rope = rows[:, :d_c], rows[:, d_c:]
        r = scale_cache[blocks, slot % page].to(compute_dtype) if scale_cache is not None else None
        for t in range(S_q):
            if indices is None:  # a prefix of the sequence
                seen = torch.arange(max(0, min(int(visible_lens[b, t]), n)), device=q_lat.device)
            else:  # the selected slots, in the order listed
                seen = slots[b, t][selected[b, t]]
            if seen.numel() == 0:
                continue
            for h in range(H):
                g = h // (H // G)
                s_content = c[seen] @ q_lat[b, t, h].to(compute_dtype)
                s_rope = k_rope[seen] @ q_rope[b, t, h].to(compute_dtype)
                if r is None:
                    s = s_content + s_rope
                elif mode == "blockwise":
                    s = r[seen, g] * s_content + s_rope
                else:
                    s = r[seen, g] * (s_content + s_rope)
                s = s * softmax_scale
                lse[b, t, h] = torch.logsumexp(s.to(score_dtype), dim=0)
                out[b, t, h] = torch.softmax(s.to(score_dtype), dim=0).to(compute_dtype) @ c[seen]
    return out, lse
