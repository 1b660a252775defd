"""Attention sinks: one learned logit s_h per head that joins the softmax's denominator and
attends to nothing (gpt-oss, HY-V4, DeepSeek-V4).

Over the scaled logits l_j a head attends to, with values v_j, the sinked output is

    o^sink = sum_j exp(l_j) v_j / (exp(s_h) + sum_j exp(l_j))
           = o * exp(L) / (exp(L) + exp(s_h)) = o * sigmoid(L - s_h)

where o = softmax(l) @ v is the sink-free output and L = logsumexp_j l_j its log-sum-exp. So a
sink needs nothing cached and nothing per key: only each query's L, which the absorbed decode op
already returns (:func:`apply_sinks`, composing with paged and quantized rows, the sparse
``indices`` and the QK norm's key scalars, which only change the l_j). A query that sees no key
(L = -inf) puts all its weight on the sink: output 0.

SDPA returns no L; over materialized keys the sink is one more key instead (:func:`sink_column`):
every query gets one more dimension holding s_h, every key a 0 there, and one extra key, visible
to every query, is 1 there and 0 elsewhere with a zero value. Its logit is exactly s_h (products
with zeros add nothing), so the fused SDPA computes the sinked output itself.

Shapes follow [B, T, H, D]: B sequences, T query tokens, S keys, h heads, G KV groups.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

Scale = Union[float, torch.Tensor]  # a float, or one value per head [h]


def check_sinks(sinks, num_heads: int) -> None:
    """A ValueError naming ``sinks`` unless it is a floating-point tensor [num_heads]."""
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point or tuple(sinks.shape) != (num_heads,):
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks: expected a floating-point tensor [h={num_heads}] of per-head logits, got {got}")


def sink_gate(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """sigmoid(L - s_h), the share of a head's softmax its keys keep beside the sink.

    Args:
        lse: [B, T, h] the log-sum-exp L of each query's scaled logits (-inf: no key seen).
        sinks: [h] the sink logits s_h.

    Returns:
        [B, T, h] in the wider of the two dtypes (float32 at least); 0 where L = -inf.
    """
    dtype = torch.promote_types(torch.promote_types(lse.dtype, sinks.dtype), torch.float32)
    return torch.sigmoid(lse.to(dtype) - sinks.to(dtype))


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinked output o * sigmoid(L - s_h) of a sink-free one.

    Args:
        out: [B, T, h, D] the sink-free attention output o (values, or the absorbed path's latent
            output, which W_UV maps linearly).
        lse: [B, T, h] its log-sum-exp L (the decode op's second output).
        sinks: [h] the sink logits.

    Returns:
        [B, T, h, D] in out's dtype.
    """
    return out * sink_gate(lse, sinks)[..., None].to(out.dtype)


def sink_column(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Scale, sinks: torch.Tensor,
                mask: Optional[torch.Tensor] = None, causal: bool = False):
    """Attention with sinks as attention without: the sink becomes one more key (module docstring).

    Args:
        q: [B, T, h, D]; k: [B, S, G, D]; v: [B, S, G, Dv]; G divides h.
        scale: the logit scale, a float or [h]; folded into q here.
        sinks: [h] the sink logits.
        mask: [B, T, S] bool, True where a key is visible, or None; causal: T == S causal (no mask).

    Returns:
        (q [B, T, h, D + 1], k [B, S + 1, G, D + 1], v [B, S + 1, G, Dv], mask [B, T, S + 1] or None,
        scale 1.0): for an attention without sinks (``functional.sdpa``) over which the last key is
        the sink, visible to every query.
    """
    B, T, h, _ = q.shape
    S, G = k.shape[1], k.shape[2]
    if isinstance(scale, torch.Tensor):
        q = q * scale.view(h, 1).to(q.dtype)
    else:
        q = q * scale
    # A sink of -inf (no sink) would meet the keys' zeros as -inf * 0 = NaN: the lowest finite logit is the same sink.
    # So would +inf (every weight on the sink): the explicit path gave NaN where the absorbed one (apply_sinks) gives
    # 0; the largest finite logit is the same sink.
    info = torch.finfo(q.dtype)
    sink = sinks.to(q.dtype).clamp(info.min, info.max)
    q = torch.cat((q, sink.view(1, 1, h, 1).expand(B, T, h, 1)), dim=-1)
    k = torch.cat((k, k.new_zeros(B, S, G, 1)), dim=-1)
    sink_key = k.new_zeros(B, 1, G, k.shape[-1])
    sink_key[..., -1] = 1
    k = torch.cat((k, sink_key), dim=1)
    v = torch.cat((v, v.new_zeros(B, 1, G, v.shape[-1])), dim=1)
    if causal:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T).expand(B, T, S)
    if mask is not None:
        mask = torch.cat((mask, mask.new_ones(B, T, 1)), dim=-1)
    return q, k, v, mask, 1.0
