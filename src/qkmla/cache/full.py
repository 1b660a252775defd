"""The cache the paper avoids: materialized (normalized) keys and values per KV head.

Used by MHA/GQA/MQA, and by MLA when a user wants the naive full-key QK-norm cache
for comparison. Per token: G heads of keys (k_dim) and values (v_dim).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..utils.checked import as_int
from .base import SequenceCache, WriteSlot, check_dims, check_dtype, check_row_widths, config_fields
from .storage import Layout


class FullKVCache(SequenceCache):
    """Keys [B, S, G * k_dim] and values [B, S, G * v_dim] of one layer.

    Keys are stored after normalization and RoPE, so reading them needs no more work.
    """

    # The widths its buffers were allocated for: cache.k_dim = 4 was taken, and the next forward was refused
    # as a cache that does not match the layer (or, matching a narrower one, failed in torch's indexing).
    FIXED = SequenceCache.FIXED + ("num_kv_heads", "k_dim", "v_dim")
    READ_ONCE = ("dtype", "fill")

    def __init__(self, batch_size: int, capacity: int, num_kv_heads: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype = torch.float32, device=None, layout: Optional[Layout] = None,
                 fill: float = 0.0):
        num_kv_heads, k_dim, v_dim = (as_int(v) for v in (num_kv_heads, k_dim, v_dim))  # a NumPy int is an int
        check_dims(num_kv_heads=num_kv_heads, k_dim=k_dim, v_dim=v_dim)
        check_dtype("dtype", dtype)
        super().__init__(batch_size, capacity, device, layout)
        # a width past memory was refused naming capacity, the one size that was fine
        check_row_widths(self.batch_size, dtype.itemsize, self.device, **{
            "num_kv_heads x k_dim": num_kv_heads * k_dim, "num_kv_heads x v_dim": num_kv_heads * v_dim})
        self.num_kv_heads, self.k_dim, self.v_dim = num_kv_heads, k_dim, v_dim
        self._add_field("k", num_kv_heads * k_dim, dtype, fill)
        self._add_field("v", num_kv_heads * v_dim, dtype, fill)

    def check_shape(self, num_kv_heads: int, k_dim: int, v_dim: int) -> None:
        """Raise ValueError unless this cache fits a layer of that shape."""
        got = (self.num_kv_heads, self.k_dim, self.v_dim)
        if got != (num_kv_heads, k_dim, v_dim):
            raise ValueError(f"cache: FullKVCache(num_kv_heads, k_dim, v_dim)={got} does not match this layer, "
                             f"which needs {(num_kv_heads, k_dim, v_dim)}; build it with FullKVCache.from_config")

    def check_config(self, config) -> None:
        """Raise ValueError unless this cache fits a layer built from ``config`` (an
        :class:`~qkmla.config.MLAConfig` or :class:`~qkmla.config.AttentionConfig`)."""
        self.check_shape(*self._shape(config))

    @staticmethod
    def _shape(config) -> tuple[int, int, int]:
        expected = "an MLAConfig or an AttentionConfig"
        if hasattr(config, "kv_lora_rank"):
            return config_fields(config, ("num_kv_groups", "qk_head_dim", "v_head_dim"), expected)
        heads, width = config_fields(config, ("num_kv_heads", "dim_per_head"), expected)
        return heads, width, width

    def update(self, slot: WriteSlot, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k [B, T, G, k_dim] and v [B, T, G, v_dim]; return every cached key and value,
        [B, S, G, k_dim] and [B, S, G, v_dim], in k's dtype."""
        B, T = slot.slots.shape
        self.check_rows("k", k, (B, T, self.num_kv_heads, self.k_dim), ("B", "T", "G"), self.stored_dtype("k"))
        self.check_rows("v", v, (B, T, self.num_kv_heads, self.v_dim), ("B", "T", "G"), self.stored_dtype("v"))
        self.write_rows(slot, {"k": k.flatten(2), "v": v.flatten(2)})
        unflat = (self.num_kv_heads, -1)
        return (self.read("k").unflatten(-1, unflat).to(k.dtype), self.read("v").unflatten(-1, unflat).to(k.dtype))

    @classmethod
    def from_config(cls, config, batch_size: int, capacity: int, **kwargs) -> "FullKVCache":
        """Shaped for an :class:`~qkmla.config.MLAConfig` or :class:`~qkmla.config.AttentionConfig`."""
        return cls(batch_size, capacity, *cls._shape(config), **kwargs)
