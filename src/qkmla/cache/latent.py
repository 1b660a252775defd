"""The QK-normed MLA decode cache: latent, normalized RoPE key, one scalar per KV group.

Per token j and layer (MATH.md, "The absorbed form"):

    latent[j]  = [c_j ; kh_j^R]          d_c + d_r values, one buffer (FlashMLA's layout)
    inv_rms[j] = r_{j,g}, g < G          G scalars, a separate buffer

r is never folded into c: it differs per group, so folding would multiply the cache by G.
For "l2"/"lp" the scalar is that norm's sigma; the field keeps the name ``inv_rms``.
Plain MLA (``num_kv_groups=0``) has no scalar buffer. In unified mode the stored RoPE key
carries its weight but not the scalar, which applies to the whole logit.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..config import MLAConfig
from .base import SequenceCache, check_dims, check_dtype
from .storage import Layout, PagedBuffer


class LatentCache(SequenceCache):
    """Preallocated latent cache of one layer for ``batch_size`` sequences.

    Args:
        batch_size: B.
        capacity: most tokens per sequence.
        kv_lora_rank: d_c.
        qk_rope_head_dim: d_r.
        num_kv_groups: G scalars per token; 0 for plain MLA.
        dtype: dtype of the latent and RoPE key.
        scalar_dtype: dtype of the scalars (default: ``dtype``).
        layout: :class:`~qkmla.cache.storage.ContiguousLayout` (default) or ``PagedLayout``.
        fill: value of never-written slots (tests use NaN so a stray read shows).

    Fields: ``latent`` [B, S, d_c + d_r], ``inv_rms`` [B, S, G].
    """

    def __init__(self, batch_size: int, capacity: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 num_kv_groups: int = 0, dtype: torch.dtype = torch.float32,
                 scalar_dtype: Optional[torch.dtype] = None, device=None, layout: Optional[Layout] = None,
                 fill: float = 0.0):
        check_dims(("num_kv_groups",), kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                   num_kv_groups=num_kv_groups)
        check_dtype("dtype", dtype)
        if scalar_dtype is not None:
            check_dtype("scalar_dtype", scalar_dtype)
        super().__init__(batch_size, capacity, device, layout)
        self.kv_lora_rank, self.qk_rope_head_dim, self.num_kv_groups = kv_lora_rank, qk_rope_head_dim, num_kv_groups
        self._add_field("latent", kv_lora_rank + qk_rope_head_dim, dtype, fill)
        if num_kv_groups:
            self._add_field("inv_rms", num_kv_groups, scalar_dtype or dtype, fill)

    def decode_view(self) -> dict:
        """What the decode op (``qkmla.ops.mla_decode.mla_decode_with_kvcache``) reads, by its
        argument names: ``kv_cache`` [num_blocks, block_size, d_c + d_r] with ``block_table``
        [B, max_blocks] (paged), or [B, capacity, d_c + d_r] with ``block_table=None``
        (contiguous); ``scale_cache`` of the same layout with width G, or None;
        ``cache_seqlens`` [B]; ``max_seqlen`` (a Python int)."""
        latent = self.fields["latent"]
        scales = self.fields.get("inv_rms")
        if isinstance(latent, PagedBuffer):
            kv, s, table = latent.pool, scales.pool if scales is not None else None, latent.block_table
        else:
            kv, s, table = latent.data, scales.data if scales is not None else None, None
        return dict(kv_cache=kv, scale_cache=s, block_table=table, cache_seqlens=self.seqlens, max_seqlen=self.max_len)

    def check_config(self, config: MLAConfig) -> None:
        """Raise ValueError unless this cache holds the rows of a layer built from ``config``."""
        want = (config.kv_lora_rank, config.qk_rope_head_dim, config.num_kv_groups if config.qk_norm is not None else 0)
        got = (self.kv_lora_rank, self.qk_rope_head_dim, self.num_kv_groups)
        if got != want:
            raise ValueError(f"cache: LatentCache(kv_lora_rank, qk_rope_head_dim, num_kv_groups)={got} does not match "
                             f"this layer, which needs {want}; build it with LatentCache.from_config(config, ...)")

    @classmethod
    def from_config(cls, config: MLAConfig, batch_size: int, capacity: int, **kwargs) -> "LatentCache":
        """A cache shaped for ``config``: scalars only when it has a QK norm."""
        groups = config.num_kv_groups if config.qk_norm is not None else 0
        return cls(batch_size, capacity, config.kv_lora_rank, config.qk_rope_head_dim, groups, **kwargs)
