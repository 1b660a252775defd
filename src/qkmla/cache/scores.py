"""The attention a layer really pays to each cached token, read from its latent cache.

With a QK norm the raw latent dot products are not the logits: the key scalars r and the
softmax scale complete them (MATH.md, "The absorbed form"). These functions build the same
logits the decode op uses (``ops.mla_decode.torch_impl.latent_scores``) and softmax them:

    blockwise: s_j = scale * (r[j, g] * (q_lat . c_j) + q_rope . k_rope_j)
    unified:   s_j = scale * r[j, g] * (q_lat . c_j + q_rope . k_rope_j)
    plain:     s_j = scale * ([q_lat, q_rope] . latent_j)
    p = softmax_j(s)     over the slots the query sees

so they equal the softmax of the explicit path's logits over materialized, normalized q and
k. Eviction policies that rank tokens by attention (H2O, SnapKV) read them.

Shapes follow [B, T, H, D]: B sequences, T query tokens, S cached slots, h query heads,
G KV groups.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..dtypes import accumulate_dtype
from ..ops.mla_decode.torch_impl import fold_head_scale, latent_scores
from .base import WriteSlot

PROBS_PER_CHUNK = 1 << 22  # probabilities held at once (16 MB of float32) while summing over queries


def attention_probs(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                    key_scale: Optional[torch.Tensor], softmax_scale: Union[float, torch.Tensor],
                    mode: str = "blockwise", mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention probabilities over a dense latent cache, in at least float32.

    Args:
        q_lat: [B, T, h, d_c] latent queries (query scalar and both norm weights folded in).
        q_rope: [B, T, h, d_r] normalized, rotated RoPE queries.
        latent: [B, S, d_c + d_r] cached [c ; k_rope]; key_scale: [B, S, G] or None (plain MLA).
        softmax_scale: tau, a float or one per head [h].
        mode: "blockwise" or "unified".
        mask: [B, T, S] bool, True where query t sees slot j; None: every slot.

    Returns:
        [B, T, h, S]; a query that sees no slot gets zeros.
    """
    acc = accumulate_dtype(q_lat.dtype)
    q_lat, q_rope = q_lat.to(acc), q_rope.to(acc)
    if isinstance(softmax_scale, torch.Tensor):  # scores for a policy: no gradient to the scale
        softmax_scale = softmax_scale.detach()
    q_lat, q_rope, softmax_scale = fold_head_scale(q_lat, q_rope, softmax_scale)
    s = latent_scores(q_lat, q_rope, latent, key_scale, mode) * softmax_scale
    if mask is not None:
        s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0)  # an all -inf row is 0/0


@torch.no_grad()
def attention_received(latent: torch.Tensor, key_scale: Optional[torch.Tensor], slot: WriteSlot,
                       observed: torch.Tensor, q_lat: torch.Tensor, q_rope: torch.Tensor,
                       softmax_scale: Union[float, torch.Tensor], mode: str = "blockwise") -> torch.Tensor:
    """Attention each cached slot received from the observed new tokens, per head.

    Args:
        latent, key_scale: the cache after the new tokens were written, [B, S, d_c + d_r] and
            [B, S, G] or None (``LatentCache.load()``: slots past a sequence's length are zero).
        slot: where the T new tokens went; its ``key_mask`` says which slots each one sees.
        observed: [B, T] bool, the new tokens whose attention counts (padding never does).
        q_lat, q_rope: the new tokens' queries, [B, T, h, d_c] and [B, T, h, d_r].

    Returns:
        [B, h, S], sum over observed queries t of p[b, t, h, j]. The queries go in chunks,
        so at most PROBS_PER_CHUNK probabilities exist at once; chunks with no observed
        query are skipped (SnapKV observes only the prompt's last tokens).
    """
    B, T, h, _ = q_lat.shape
    S = latent.shape[1]
    mask = slot.key_mask()
    total = torch.zeros(B, h, S, dtype=accumulate_dtype(q_lat.dtype), device=q_lat.device)
    chunk = max(1, PROBS_PER_CHUNK // max(1, B * h * S))
    for start in range(0, T, chunk):
        stop = min(T, start + chunk)
        weight = observed[:, start:stop]
        if not bool(weight.any()):
            continue
        p = attention_probs(q_lat[:, start:stop], q_rope[:, start:stop], latent, key_scale, softmax_scale, mode,
                            mask[:, start:stop] if mask is not None else None)  # [B, t, h, S]
        total += torch.einsum("bthj,bt->bhj", p, weight.to(p.dtype))
    return total
