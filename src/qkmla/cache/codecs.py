"""The codec of a latent cache: a row's parts <-> the cache's stored fields.

A :class:`LatentCache` stores two fields per token: ``latent``, the row of a format from
``qkmla.kv_formats`` ([c ; k^R] in the cache's dtype for "dense", or a uint8 row of a
quantized latent, its scales and a bfloat16 k^R), and ``key_scale``, the G key scalars
r in ``scalar_dtype`` (QK-normed layers only), never quantized with the latent.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kv_formats import DenseRows, row_format


class LatentCodec:
    """fields / store / load of a latent cache whose latent rows have format ``rows``
    (default: dense; the buffers cast rows to their field's dtype on write)."""

    def __init__(self, kv_lora_rank: int, qk_rope_head_dim: int, kv_format: str = "dense"):
        self.rows: DenseRows = row_format(kv_format, kv_lora_rank, qk_rope_head_dim)

    def fields(self, num_kv_groups: int, dtype: torch.dtype, scalar_dtype: torch.dtype) -> dict[str, tuple]:
        """{field name: (width, dtype)} of the stored rows."""
        fields = {"latent": (self.rows.width, self.rows.storage_dtype(dtype))}
        if num_kv_groups:
            fields["key_scale"] = (num_kv_groups, scalar_dtype)
        return fields

    def store(self, c_kv: torch.Tensor, k_rope: torch.Tensor, key_scale: Optional[torch.Tensor]) -> dict:
        """Rows [B, T, width] of every field from c [B, T, d_c], k^R [B, T, d_r], r [B, T, G] or None."""
        rows = {"latent": self.rows.encode(c_kv, k_rope)}
        if key_scale is not None:
            rows["key_scale"] = key_scale
        return rows

    def load(self, rows: dict, dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(latent [B, S, d_c + d_r] (a quantized one dequantized, in float32 or ``dtype``), key
        scalars [B, S, G] or None) from stored rows [B, S, width]."""
        latent = self.rows.decode(rows["latent"])
        return (latent if dtype is None else latent.to(dtype)), rows.get("key_scale")
