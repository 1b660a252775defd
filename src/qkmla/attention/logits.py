"""The causal pre-softmax logits of one MLA layer, computed both ways.

MATH.md's Appendix E test: the logits from materialized, normalized keys (explicit) and
from latent dot products scaled by the cached key scalars (absorbed) must agree to
roundoff. ``qkmla verify`` and the demo compare the two; the eviction tests read the
explicit ones as attention weights.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..dtypes import accumulate_dtype
from ..ops.mla_decode.torch_impl import latent_scores
from .functional import check_hidden, default_positions, per_head

LOGIT_PATHS = ("explicit", "absorbed")


def causal_logits(mla, x: torch.Tensor, path: str = "explicit", positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal pre-softmax logits [B, h, T, T] of one sequence chunk x [B, T, hidden] (masked entries -inf).

    ``path="explicit"`` dots ``mla``'s materialized normalized keys; ``path="absorbed"`` forms
    the chunk's cache rows and uses latent dot products scaled by the scalars.
    """
    if path not in LOGIT_PATHS:
        raise ValueError(f"path: expected one of {LOGIT_PATHS}, got {path!r}")
    check_hidden(x, mla.config.hidden_size, mla.o_proj.weight.dtype, mla.o_proj.weight.device)
    positions = default_positions(x, positions)
    T = x.shape[1]
    if path == "explicit":
        q, k, _ = mla.explicit_qkv(x, positions)
        k = k.repeat_interleave(mla.config.heads_per_group, dim=2)
        s = torch.einsum("bthd,bshd->bths", q, k).to(accumulate_dtype(q.dtype))
    else:
        q_lat, q_rope = mla.absorbed_query(x, positions)
        rows = mla.cache_rows(x, positions)
        latent = torch.cat((rows["c_kv"], rows["k_rope"]), dim=-1)
        s = latent_scores(q_lat, q_rope, latent, rows["key_scale"], mla.score_mode)
    s = s * per_head(mla.scale, 1)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    return s.masked_fill(~causal[:, None, :], float("-inf")).transpose(1, 2)
