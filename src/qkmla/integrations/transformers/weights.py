"""Attention weights in transformers' layout, for ``output_attentions=True`` on a patched model.

The absorbed path never forms transformers' probabilities, so they are computed here, explicitly
and only when asked, from the same queries and keys (equal to the absorbed scores to roundoff):

    weights[b, i, t, s] = softmax_s(tau · q[b, t, i] · k[b, s, g(i)])     (masked entries 0)

and laid out as transformers returns them, [B, h, T, K]: T the call's tokens, K the key columns
of the caller's 2-D ``attention_mask`` (cached columns, then the call's; padding columns get 0,
as the latent cache never holds padding).

A padding query's row is the one its output was computed from, on every path (no cache, the
growing cache, the static one): over the real tokens before it, as transformers' attention gives
it (a right-padded batch), or 0 where it sees none (left padding), as transformers' sdpa, the
default, gives it (a zero output). That holds whatever ``attn_implementation`` the model had
before it was patched: transformers' eager attention gives such a row 1/K over every column
(its mask adds the dtype's minimum to every score: the row is flat; in float64 its float32
softmax of -inf makes it NaN), and the output from it, the mean of every column's value, padding
included, which the latent cache never holds: weights of 1/K beside the output qkmla computes
would describe another function than the model's.
"""

from __future__ import annotations

from typing import Optional

import torch


def explicit_weights(q: torch.Tensor, k: torch.Tensor, scale, visible: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax(tau q k^T) [B, h, T, S] from q [B, T, h, d], k [B, S, G, d] (head i uses group
    i // (h / G)) and ``visible`` [B, T, S] bool (None: causal, S == T); tau a float or [h]."""
    B, T, h, _ = q.shape
    S, G = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // G, dim=2) if G != h else k
    tau = scale.view(1, h, 1, 1) if isinstance(scale, torch.Tensor) else scale
    scores = torch.einsum("bthd,bshd->bhts", q.float() if q.dtype.itemsize < 4 else q,
                          k.float() if k.dtype.itemsize < 4 else k) * tau
    if visible is None:
        visible = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)[None]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with nothing visible: zeros
    return weights.to(q.dtype)


def cached_weights(attn, x: torch.Tensor, layer, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[B, h, T, K] for the call's tokens x [B, T, hidden] after they went into ``layer`` (a
    ``LatentCacheLayer`` whose ``stored`` [B, K] marks the cached columns), over every cached token;
    the queries at ``positions`` [B, T] (the RoPE positions their keys were cached at; None: the
    cache's own numbering). A padding query's row covers the real tokens before it where its output
    does (``LatentAttention._padding_queries``: transformers' positions, no eviction policy), else 0."""
    cache, stored = layer.latent, layer.stored
    B, T = x.shape[:2]
    K = stored.shape[1]
    device = x.device
    stored = stored.to(device)
    latent, key_scale = cache.load()  # [B, S, d_c + d_r]: each row's cached tokens, in order
    k, _ = attn.expand_cache(latent, key_scale)
    S = k.shape[1]
    seqlens = cache.seqlens.to(device)
    index = stored.long().cumsum(dim=1) - 1  # [B, K]: each stored column's slot
    own = index[:, K - T:]  # [B, T]: the call's tokens' slots (padding: its last real one's)
    first = (cache.next_positions.to(device) - seqlens)[:, None]  # slot s sits at position first + s
    q = attn.explicit_query(x, positions.to(device) if positions is not None else first + own.clamp(min=0))
    slots = torch.arange(S, device=device)
    visible = (slots[None, None, :] <= own[:, :, None]) & (slots[None, None, :] < seqlens[:, None, None])
    weights = explicit_weights(q, k, attn.scale, visible)  # [B, h, T, S]
    if positions is None or attn.settings.policy is not None:  # padding queries' outputs are 0 then: so are their rows
        weights = weights * stored[:, K - T:, None].to(weights.dtype)[:, None]
    # else a padding query (own: its last real token's slot) sees the real tokens before it, as its output does: its
    # row was zeroed, 0.29 off transformers' and the no-cache path's rows, beside an output computed from them
    out = weights.new_zeros(B, weights.shape[1], T, K)
    order = torch.argsort((~stored).to(torch.int8), dim=1, stable=True)  # stored columns first, in order
    width = min(S, K)
    columns = order[:, :width]
    out.scatter_(3, columns[:, None, None, :].expand(B, out.shape[1], T, width), weights[..., :width])
    return out
