"""The cache of shared-KV attention (DeepSeek-V4): one vector per token that is both its key and
its value, stored after its norm and RoPE. Per token and layer: D values."""

from __future__ import annotations

from typing import Optional

import torch

from ..utils.checked import as_int
from .base import SequenceCache, WriteSlot, check_dims, check_dtype, check_row_widths, config_fields
from .storage import Layout


class SharedKVCache(SequenceCache):
    """Shared key = value rows [B, S, D] of one layer."""

    FIXED = SequenceCache.FIXED + ("head_dim",)  # its buffer's width, as FullKVCache's and LatentCache's
    READ_ONCE = ("dtype", "fill")

    def __init__(self, batch_size: int, capacity: int, head_dim: int, dtype: torch.dtype = torch.float32,
                 device=None, layout: Optional[Layout] = None, fill: float = 0.0):
        head_dim = as_int(head_dim)  # np.int64(16) was refused as "expected an int >= 1, got np.int64(16)"
        check_dims(head_dim=head_dim)
        check_dtype("dtype", dtype)
        super().__init__(batch_size, capacity, device, layout)
        check_row_widths(self.batch_size, dtype.itemsize, self.device, head_dim=head_dim)  # else named capacity
        self.head_dim = head_dim
        self._add_field("kv", head_dim, dtype, fill)

    def check_config(self, config) -> None:
        """Raise ValueError unless this cache fits a layer built from ``config`` (a
        :class:`~qkmla.config.SharedKVConfig`)."""
        if config.head_dim != self.head_dim:
            raise ValueError(f"cache: SharedKVCache(head_dim={self.head_dim}) does not match this layer, which "
                             f"needs head_dim={config.head_dim}; build it with SharedKVCache.from_config")

    def update(self, slot: WriteSlot, kv: torch.Tensor) -> torch.Tensor:
        """Store kv [B, T, 1, D]; return every cached row [B, S, 1, D] in kv's dtype."""
        B, T = slot.slots.shape  # checked as FullKVCache.update checks its keys (SequenceCache.check_rows)
        self.check_rows("kv", kv, (B, T, 1, self.head_dim), ("B", "T", "heads"), self.stored_dtype("kv"))
        self.write_rows(slot, {"kv": kv.flatten(2)})
        return self.read("kv").unsqueeze(2).to(kv.dtype)

    @classmethod
    def from_config(cls, config, batch_size: int, capacity: int, **kwargs) -> "SharedKVCache":
        """Shaped for a :class:`~qkmla.config.SharedKVConfig`."""
        return cls(batch_size, capacity, *config_fields(config, ("head_dim",), "a SharedKVConfig"), **kwargs)
