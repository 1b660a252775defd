"""The specification of the MLA decode op, as a readable float32 loop.

Paged latent cache (FlashMLA layout) plus a paged scalar cache:

    kv_cache     [num_blocks, block_size, d_c + d_r]   rows [c ; k_rope]
    scale_cache  [num_blocks, block_size, G]           key scalars r (None: plain MLA)
    block_table  [B, max_blocks]                       token j of sequence b lives in block
                                                       block_table[b, j // block_size], slot j % block_size
    cache_seqlens [B]                                  tokens cached, the S_q new ones included

Query t of S_q (the last S_q tokens of the sequence) sees keys j < seqlen - S_q + t + 1:

    keys:     0 1 2 ... n-3 n-2 n-1          (n = seqlen, S_q = 2)
    query 0:  x x x ...  x   x   .
    query 1:  x x x ...  x   x   x

For head h in group g = h // (H / G):

    s_j = scale * (r[j, g] * (q_lat . c_j) + q_rope . k_rope_j)      (r = 1 without scales)
    out = softmax(s) @ c          (latent output; W_UV is applied afterwards)
    lse = logsumexp(s)            (-inf, with out = 0, when no key is visible)
"""

from __future__ import annotations

from typing import Optional

import torch


def naive_mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                     cache_seqlens: torch.Tensor, scale_cache: Optional[torch.Tensor] = None,
                     softmax_scale: float = 1.0, compute_dtype: torch.dtype = torch.float32):
    """Returns (out [B, S_q, H, d_c] in ``compute_dtype``, lse [B, S_q, H] float32).

    ``compute_dtype=torch.bfloat16`` gives "a plain bf16 PyTorch implementation", the
    baseline of the kernel's error budget.
    """
    B, S_q, H, d_c = q_lat.shape
    G = scale_cache.shape[-1] if scale_cache is not None else 1
    page = kv_cache.shape[1]
    out = torch.zeros(B, S_q, H, d_c, dtype=compute_dtype, device=q_lat.device)
    lse = torch.full((B, S_q, H), float("-inf"), dtype=torch.float32, device=q_lat.device)
    for b in range(B):
        n = int(cache_seqlens[b])
        pos = torch.arange(n, device=q_lat.device)
        blocks = block_table[b, pos // page].long()
        rows = kv_cache[blocks, pos % page].to(compute_dtype)  # [n, d_c + d_r]
        c, k_rope = rows[:, :d_c], rows[:, d_c:]
        r = scale_cache[blocks, pos % page].to(compute_dtype) if scale_cache is not None else None
        for t in range(S_q):
            visible = n - S_q + t + 1
            if visible <= 0:
                continue
            for h in range(H):
                g = h // (H // G)
                s_content = c[:visible] @ q_lat[b, t, h].to(compute_dtype)
                if r is not None:
                    s_content = s_content * r[:visible, g]
                s = (s_content + k_rope[:visible] @ q_rope[b, t, h].to(compute_dtype)) * softmax_scale
                lse[b, t, h] = torch.logsumexp(s.float(), dim=0)
                out[b, t, h] = torch.softmax(s.float(), dim=0).to(compute_dtype) @ c[:visible]
    return out, lse
