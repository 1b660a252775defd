"""The QK-normed MLA decode cache: latent, normalized RoPE key, one scalar per KV group.

Per token j and layer (MATH.md, "The absorbed form"):

    latent[j]    = [c_j ; kh_j^R]        d_c + d_r values, one buffer (FlashMLA's layout)
    key_scale[j] = r_{j,g}, g < G        G scalars, a separate buffer

r is the key norm's statistic sigma(c_j W_UK^(g)): the inverse RMS for "rms", 1 / |k|_2
for "l2", 1 / |k|_p for "lp". It is never folded into c: it differs per group, so folding
would multiply the cache by G. Plain MLA (``num_kv_groups=0``) has no scalar buffer. In
unified mode the stored RoPE key carries its weight but not the scalar, which applies to
the whole logit.

The cache owns this row format. Attention code hands it the row's parts
(:meth:`LatentCache.append`) and hands the decode op what :meth:`LatentCache.decode_view`
returns. Between the parts and the stored fields sits a codec (:class:`LatentCodec`:
``fields``, ``store``, ``load``), where another storage format (a quantized latent with
per-tile scales, say) plugs in; such a format also overrides ``decode_view`` for an op
backend that reads it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..config import MLAConfig
from .base import SequenceCache, WriteSlot, check_dims, check_dtype
from .eviction import EvictionPolicy
from .evictor import Eviction
from .storage import Layout, PagedBuffer


class LatentCodec:
    """The stored form of a latent-cache row: the latent and RoPE key as one row, the
    scalars as another, each in its field's dtype (the buffer casts on write)."""

    def fields(self, kv_lora_rank: int, qk_rope_head_dim: int, num_kv_groups: int, dtype: torch.dtype,
               scalar_dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        """{field name: (width, dtype)} of the stored rows."""
        fields = {"latent": (kv_lora_rank + qk_rope_head_dim, dtype)}
        if num_kv_groups:
            fields["key_scale"] = (num_kv_groups, scalar_dtype)
        return fields

    def store(self, c_kv: torch.Tensor, k_rope: torch.Tensor, key_scale: Optional[torch.Tensor]) -> dict:
        """Rows [B, T, width] of every field from c [B, T, d_c], k^R [B, T, d_r], r [B, T, G] or None."""
        rows = {"latent": torch.cat((c_kv, k_rope.to(c_kv.dtype)), dim=-1)}
        if key_scale is not None:
            rows["key_scale"] = key_scale
        return rows

    def load(self, rows: dict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(latent [B, S, d_c + d_r], key scalars [B, S, G] or None) from stored rows [B, S, width]."""
        return rows["latent"], rows.get("key_scale")


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
        policy: an :class:`~qkmla.cache.eviction.EvictionPolicy` that drops cached tokens
            (StreamingLLM, H2O, SnapKV), or None to keep every token.

    Fields (default codec): ``latent`` [B, S, d_c + d_r], ``key_scale`` [B, S, G].
    """

    codec = LatentCodec()

    def __init__(self, batch_size: int, capacity: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 num_kv_groups: int = 0, dtype: torch.dtype = torch.float32,
                 scalar_dtype: Optional[torch.dtype] = None, device=None, layout: Optional[Layout] = None,
                 fill: float = 0.0, policy: Optional[EvictionPolicy] = None):
        check_dims(("num_kv_groups",), kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                   num_kv_groups=num_kv_groups)
        check_dtype("dtype", dtype)
        if scalar_dtype is not None:
            check_dtype("scalar_dtype", scalar_dtype)
        super().__init__(batch_size, capacity, device, layout)
        if policy is not None:
            self.eviction = Eviction(policy, batch_size, self.device)
        self.kv_lora_rank, self.qk_rope_head_dim, self.num_kv_groups = kv_lora_rank, qk_rope_head_dim, num_kv_groups
        for name, (width, field_dtype) in self.codec.fields(kv_lora_rank, qk_rope_head_dim, num_kv_groups, dtype,
                                                            scalar_dtype or dtype).items():
            self._add_field(name, width, field_dtype, fill)

    def append(self, slot: WriteSlot, *, c_kv: torch.Tensor, k_rope: torch.Tensor,
               key_scale: Optional[torch.Tensor] = None) -> None:
        """Store the new tokens' rows at ``slot`` (from :meth:`plan`): c [B, T, d_c], the
        normalized, rotated RoPE key k^R [B, T, d_r] and, with a QK norm, the key scalars
        r [B, T, G]."""
        B, T = slot.slots.shape
        want = {"c_kv": (c_kv, self.kv_lora_rank), "k_rope": (k_rope, self.qk_rope_head_dim),
                "key_scale": (key_scale, self.num_kv_groups)}
        for name, (t, width) in want.items():
            if width == 0 and t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.shape != (B, T, width):
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else t
                raise ValueError(f"{name}: expected a tensor [B={B}, T={T}, {width}] for this cache, got {got}")
        self.write_rows(slot, self.codec.store(c_kv, k_rope, key_scale))

    def load(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Every sequence's first max(seqlens) slots: (latent [B, S, d_c + d_r], key scalars
        [B, S, G] or None), slots past a shorter sequence's length zeroed."""
        return self.codec.load({name: self.read(name) for name in self.fields})

    def decode_view(self) -> dict:
        """What the decode op (``qkmla.ops.mla_decode.mla_decode_with_kvcache``) reads, by its
        argument names: ``kv_cache`` [num_blocks, block_size, d_c + d_r] with ``block_table``
        [B, max_blocks] (paged), or [B, capacity, d_c + d_r] with ``block_table=None``
        (contiguous); ``scale_cache`` of the same layout with width G, or None;
        ``cache_seqlens`` [B]; ``max_seqlen`` (a Python int)."""
        latent = self.fields["latent"]
        scales = self.fields.get("key_scale")
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

    def after_attention(self, layer, slot: WriteSlot, queries: Callable[[], tuple]) -> None:
        """The attention layer's call after each forward that wrote ``slot`` and attended: the
        eviction policy, if any, scores the cached slots with the layer's real logits and may
        drop tokens (``evictor.py``). Without a policy it returns at once, reading nothing.

        Args:
            layer: the MLA module; a policy reads its ``scale`` (a float or one per head [h]),
                ``score_mode`` ("blockwise" or "unified") and ``rotary`` (for re-positioning).
            queries: returns the new tokens' (q_lat [B, T, h, d_c], q_rope [B, T, h, d_r]) as
                the decode op takes them; called only when the policy reads attention.
        """
        if self.eviction is not None:
            self.eviction.after_attention(self, layer, slot, queries)
