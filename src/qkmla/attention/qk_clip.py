"""QK-Clip (MuonClip, Kimi K2): the logit-clipping baseline, and per-head max logits.

After an optimizer step, every head h whose largest pre-softmax logit in the step, S_h,
exceeds tau gets gamma_h = tau / S_h (heads under tau: gamma_h = 1), and its weights are
rescaled so that every logit of that head is multiplied by exactly gamma_h:

* MLA: content query rows (W_UQ, head h) and content key rows (W_UK, head h) by
  sqrt(gamma_h); RoPE query rows of head h by gamma_h; the shared RoPE key untouched.
* MHA / GQA: query rows by gamma_h^alpha and key rows by gamma_h^(1 - alpha).

Shared key heads (GQA, or MLA with G < h): a key head serves several query heads, so it
takes the smallest gamma among them, b = min_h gamma_h^(1-alpha) (MLA: sqrt(min gamma_h)),
and each query head gets gamma_h / b on the part of its logit that the key scales. Every
head's logits are then multiplied by exactly its own gamma_h, clipped or not (unclipped
heads: 1), which is the property the tests check. With G = h this is Kimi's rule.

Clipping a QK-normed layer would be undone by the norm, so it is refused.
"""

from __future__ import annotations

import math
from typing import Union

import torch

from ..config import SOFTMAX_SCALE_RANGE
from ..dtypes import accumulate_dtype
from ..utils.checked import is_number
from .mha import MultiHeadAttention
from .mla import MLA

Attention = Union[MLA, MultiHeadAttention]


def check_tau(tau) -> None:
    """A ValueError naming tau unless it is a number > 0 (inf: never clip). A string or None failed in the comparison
    with a TypeError naming nothing, True was a threshold of 1, and a subnormal tau (1e-320) made every gamma 0."""
    if not is_number(tau) or math.isnan(tau) or not tau >= SOFTMAX_SCALE_RANGE[0]:
        raise ValueError(f"tau: expected a positive threshold of at least {SOFTMAX_SCALE_RANGE[0]!r} (float32's "
                         f"smallest normal; Kimi K2: 100; inf never clips), got {tau!r}")


def clip_factors(max_logit: torch.Tensor, tau: float) -> torch.Tensor:
    """gamma_h = min(1, tau / S_h), per head."""
    check_tau(tau)
    return torch.clamp(tau / max_logit.clamp_min(torch.finfo(max_logit.dtype).tiny), max=1.0)


def _group_key_factor(gamma: torch.Tensor, groups: int, power: float) -> torch.Tensor:
    """Per key head: (smallest gamma of its query heads) ** power. [h] -> [G]."""
    return gamma.view(groups, -1).amin(dim=1).pow(power)


def mla_clip_row_factors(gamma: torch.Tensor, groups: int, d_n: int, d_r: int, d_v: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's QK-Clip as one factor per output row of the query up-projection W_Q [h (d_n + d_r), .]
    and of the key/value up-projection W_KV [G (d_n + d_v), .]: the content query rows of head h by
    gamma_h / b_g, its RoPE query rows by gamma_h, the content key rows of group g by
    b_g = sqrt(min gamma over g's heads), the value rows by 1 (the shared RoPE key is untouched).
    Every logit of head h is then multiplied by exactly gamma_h. gamma: [h] -> ([h (d_n + d_r)],
    [G (d_n + d_v)]); a caller scales its weights' rows (local shards included) by them."""
    heads = gamma.shape[0]
    key = _group_key_factor(gamma, groups, 0.5)  # content key rows of each group
    query_content = gamma / key.repeat_interleave(heads // groups)
    w_q = torch.cat((query_content[:, None].expand(heads, d_n), gamma[:, None].expand(heads, d_r)), dim=1)
    w_kv = torch.cat((key[:, None].expand(groups, d_n), torch.ones_like(key)[:, None].expand(groups, d_v)), dim=1)
    return w_q.reshape(-1), w_kv.reshape(-1)


@torch.no_grad()
def qk_clip_(module: Attention, max_logit: torch.Tensor, tau: float = 100.0, alpha: float = 0.5) -> torch.Tensor:
    """Rescale ``module``'s Q/K weights in place so each head's logits shrink by gamma_h.

    Args:
        module: an :class:`MLA` or :class:`MultiHeadAttention` without QK norm.
        max_logit: [h], each head's largest pre-softmax logit in the step.
        tau: the threshold (Kimi K2: 100).
        alpha: the query's share of the exponent for MHA/GQA (0.5). MLA's split is fixed
            (content sqrt(gamma) on both sides, RoPE query gamma).

    Returns:
        gamma [h], the factor each head's logits were multiplied by (1 where not clipped).
    """
    if not isinstance(module, (MLA, MultiHeadAttention)):  # failed reading .config: "'Linear' object has no ..."
        raise ValueError(f"module: expected an MLA or MultiHeadAttention layer, got {type(module).__name__}")
    c = module.config
    if c.has_qk_norm:
        raise ValueError(f"module: QK-Clip is for layers without QK norm (got qk_norm={c.qk_norm.kind!r}); "
                         "a norm would undo the rescaling")
    if isinstance(module, MLA) and c.q_lora_rank is not None and getattr(module, "q_b_proj", None) is None:
        raise ValueError(f"module: {type(module).__name__}'s query comes from a fused projection without q_b_proj "
                         f"(AXK2's q_gate_proj, whose rows also hold an output gate), which QK-Clip does not "
                         f"rescale; QK-Clip takes layers whose query is q_proj or q_b_proj")
    check_tau(tau)
    if not is_number(alpha) or not 0.0 <= alpha <= 1.0:  # "0.5" or None: a TypeError naming nothing; True taken as 1
        raise ValueError(f"alpha: expected a number in [0, 1], got {alpha!r}")
    if not isinstance(max_logit, torch.Tensor) or max_logit.shape != (c.num_heads,) or max_logit.is_complex() \
            or max_logit.dtype == torch.bool:
        got = tuple(max_logit.shape) if isinstance(max_logit, torch.Tensor) else type(max_logit).__name__
        raise ValueError(f"max_logit: expected a real tensor of shape [{c.num_heads}], got {got}")
    # A NaN max logit (a diverged step) made its head's gamma NaN and every weight of the head NaN; +inf made it 0
    # and zeroed them: both without a word, and past undoing. Refused before any weight is touched (-inf is a head
    # that measured nothing, and is not clipped).
    bad = max_logit.detach().isnan() | max_logit.detach().isposinf()
    if bool(bad.any()):
        heads = bad.nonzero().flatten().tolist()
        raise ValueError(f"max_logit: expected max logits below +inf, got {max_logit[heads].tolist()} at heads {heads} "
                         f"(a diverged step); the weights were left as they are")
    gamma = clip_factors(max_logit.detach().to(accumulate_dtype(max_logit.dtype)), tau)
    if bool((gamma == 1).all()):
        return gamma
    if isinstance(module, MLA):
        w_q = module.q_proj.weight if c.q_lora_rank is None else module.q_b_proj.weight
        w_q_rows, w_kv_rows = mla_clip_row_factors(gamma, c.num_kv_groups, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                                   c.v_head_dim)
        w_q.mul_(w_q_rows.to(w_q.dtype)[:, None])
        module.kv_b_proj.weight.mul_(w_kv_rows.to(module.kv_b_proj.weight.dtype)[:, None])
    else:
        G = c.num_kv_heads
        key = _group_key_factor(gamma, G, 1.0 - alpha)
        query = gamma / key.repeat_interleave(c.num_heads // G)
        w_q = module.q_proj.weight.view(c.num_heads, c.dim_per_head, -1)
        w_q.mul_(query.to(w_q.dtype)[:, None, None])
        w_k = module.k_proj.weight.view(G, c.dim_per_head, -1)
        w_k.mul_(key.to(w_k.dtype)[:, None, None])
    return gamma
