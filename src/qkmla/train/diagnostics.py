"""What bounds a QK-normed layer's logits: the temperature cap of its norm weights.

A QK norm fixes each block's query and key length, so the dot product of a block of width
n is at most ``max_i |gamma_q,i gamma_k,i|`` times a constant c(n) of the norm:

    rms:  ||v||_2 = sqrt(n)            ->  c(n) = n
    l2:   ||v||_2 = 1                  ->  c(n) = 1
    lp:   ||v||_p = 1, ||v||_2 <= n^max(0, 1/2 - 1/p)  ->  c(n) = n^max(0, 1 - 2/p)

and a head's logit is at most tau_h x the sum over its blocks (content and RoPE blockwise,
one block of width d_n + d_r unified; eps ignored). With unit weights and the default
tau = (d_n + d_r)^-1/2, a blockwise-RMS MLA head can never exceed sqrt(d_n + d_r): a low
learning rate that leaves the weights near one leaves the softmax that soft.

With the projection scope (``QKNormConfig.scope``) the statistic is pooled over a token's h query heads (G key
groups), so one head may hold the whole projection's length: RMS's per-block constant grows by
sqrt(h G) (sqrt(h) for the RoPE block, whose G key copies are one vector); the l2 and lp constants
hold for any sub-vector of a unit vector and do not change.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..attention.mha import MultiHeadAttention
from ..attention.mla import MLA
from ..attention.shared_kv import SharedKVAttention
from ..norms import rows_per_head


def _block_constant(kind: str, p: float, n: int) -> float:
    if kind == "rms":
        return float(n)
    if kind == "l2":
        return 1.0
    return float(n) ** max(0.0, 1.0 - 2.0 / p)


def _gain(q_weight: torch.Tensor, k_weight: torch.Tensor) -> float:
    """max |gamma_q gamma_k| over the channels a head's query meets its key in (weights [n], or a row
    per head [h, n] and per KV group [G, n] with the projection scope)."""
    q = q_weight.detach().float()
    return float((q * rows_per_head(k_weight.detach().float(), q.shape[0])).abs().max())


def _pooled(kind: str, c, key_vectors: int) -> float:
    """How much longer than one vector's a head's normalized block can be when the statistic is pooled
    over the projection (module docstring): sqrt(h x key_vectors) for RMS, 1 otherwise."""
    if kind != "rms" or c.qk_norm.scope != "projection":
        return 1.0
    return (c.num_heads * key_vectors) ** 0.5


@torch.no_grad()
def logit_bound(attn) -> Optional[float]:
    """The largest |logit| any input can give ``attn`` (an MLA or MHA layer) with its current
    norm weights and logit scale; None without a QK norm, and in MLA's content mode, whose RoPE
    block takes the content block's statistic and so has no fixed length (unbounded)."""
    c = attn.config
    if isinstance(attn, SharedKVAttention):
        # |q_h . c| <= |q_h| |c|: an unweighted unit-RMS query has length sqrt(D), the shared
        # vector at most max|w| sqrt(D) (RoPE rotates pairs, lengths stay): tau D max|w|.
        return c.scale * c.head_dim * float(attn.kv_norm.weight.detach().abs().max())
    if not c.has_qk_norm or c.qk_norm.mode == "content":
        return None
    kind, p = c.qk_norm.kind, c.qk_norm.p
    if isinstance(attn, MLA):
        qn, kn = attn.q_norm, attn.k_norm
        G = c.num_kv_groups
        if c.qk_norm.mode == "unified":
            gain = max(_gain(qn.content.weight, kn.content.weight), _gain(qn.rope.weight, kn.rope.weight))
            dot = _block_constant(kind, p, c.qk_head_dim) * _pooled(kind, c, G) * gain
        else:
            dot = (_block_constant(kind, p, c.qk_nope_head_dim) * _pooled(kind, c, G)
                   * _gain(qn.content.weight, kn.content.weight)
                   + _block_constant(kind, p, c.qk_rope_head_dim) * _pooled(kind, c, 1)
                   * _gain(qn.rope.weight, kn.rope.weight))
    elif isinstance(attn, MultiHeadAttention):
        dot = _block_constant(kind, p, c.dim_per_head) * _gain(attn.q_norm.weight, attn.k_norm.weight)
    else:
        raise ValueError(f"attn: expected an MLA or MultiHeadAttention, got {type(attn).__name__}")
    scale = attn.scale
    tau = float(scale.detach().abs().max()) if isinstance(scale, torch.Tensor) else float(scale)
    return tau * dot


@torch.no_grad()
def forward_max_logits(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """[layers, h]: each head's largest pre-softmax logit in one no-grad forward of ``x``
    [B, T] through ``model``'s current weights (a GPT: ``model.blocks[i].attn``).

    What QK-Clip's clipped weights really produce on a batch: run it after the clip on the
    batch the clip was computed from. Eval mode (no dropout draws, so the training RNG
    stream is untouched); the model's mode and tracking flags are restored afterwards."""
    attns = [block.attn for block in model.blocks]
    training, tracked = model.training, [a.track_max_logits for a in attns]
    model.eval()
    for a in attns:
        a.track_max_logits = True
    try:
        model(x)
        return torch.stack([a.last_max_logits.float() for a in attns])
    finally:
        model.train(training)
        for a, t in zip(attns, tracked):
            a.track_max_logits = t


def logit_scale(attn) -> Optional[float]:
    """The mean learned logit scale of a layer, or None when the scale is fixed."""
    s = getattr(attn, "logit_scale", None)
    return None if s is None else float(s.detach().float().mean())
