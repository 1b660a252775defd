"""The codecs of a latent cache: a row's parts <-> the cache's stored fields.

A :class:`LatentCache` stores two fields per token: ``latent``, the row of a format from
``qkmla.kv_formats``, and ``key_scale``, the G key scalars r in ``scalar_dtype``
(QK-normed layers only), never quantized with the latent.

* :class:`LatentCodec` (the default, ``kv_format="dense"``): ``latent`` = [c ; k^R] in the
  cache's dtype.
* :class:`QuantizedCodec` (``kv_format`` "fp8", "int8", "int4"): ``latent`` is a uint8 row
  of a quantized latent, its float32 scales and a bfloat16 k^R; ``load`` dequantizes.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kv_formats import DenseRows, dense_row


class LatentCodec:
    """The stored form of a latent-cache row: the latent and RoPE key as one row, the
    scalars as another, each in its field's dtype (the buffer casts on write)."""

    kv_format = "dense"

    def fields(self, kv_lora_rank: int, qk_rope_head_dim: int, num_kv_groups: int, dtype: torch.dtype,
               scalar_dtype: torch.dtype) -> dict[str, tuple[int, torch.dtype]]:
        """{field name: (width, dtype)} of the stored rows."""
        fields = {"latent": (kv_lora_rank + qk_rope_head_dim, dtype)}
        if num_kv_groups:
            fields["key_scale"] = (num_kv_groups, scalar_dtype)
        return fields

    def store(self, c_kv: torch.Tensor, k_rope: torch.Tensor, key_scale: Optional[torch.Tensor]) -> dict:
        """Rows [B, T, width] of every field from c [B, T, d_c], k^R [B, T, d_r], r [B, T, G] or None."""
        rows = {"latent": self.encode(c_kv, k_rope)}
        if key_scale is not None:
            rows["key_scale"] = key_scale
        return rows

    def encode(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """The ``latent`` field's rows [..., width] from c [..., d_c] and k^R [..., d_r]."""
        return dense_row(c_kv, k_rope)  # widths checked by the cache (append)

    def load(self, rows: dict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(latent [B, S, d_c + d_r], key scalars [B, S, G] or None) from stored rows [B, S, width]."""
        return rows["latent"], rows.get("key_scale")

    def stored_latent(self, c_kv: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """c [..., d_c] as a cache storing the ``latent`` field in ``dtype`` reads it back
        (dense: c rounded to ``dtype``; None: c itself); the key scalars are computed from it."""
        return DenseRows.stored_latent(c_kv, dtype)


class QuantizedCodec(LatentCodec):
    """``latent`` as one uint8 row of a quantized row format (``qkmla.kv_formats``: codes, float32
    scales, bfloat16 k^R); ``load`` returns it dequantized, in float32."""

    def __init__(self, rows: DenseRows):
        self.rows = rows
        self.kv_format = rows.name

    def fields(self, kv_lora_rank, qk_rope_head_dim, num_kv_groups, dtype, scalar_dtype):
        fields = super().fields(kv_lora_rank, qk_rope_head_dim, num_kv_groups, dtype, scalar_dtype)
        return {**fields, "latent": (self.rows.width, torch.uint8)}

    def encode(self, c_kv, k_rope):
        return self.rows.encode(c_kv, k_rope)

    def load(self, rows):
        return self.rows.decode(rows["latent"]), rows.get("key_scale")

    def stored_latent(self, c_kv, dtype=None):
        return self.rows.stored_latent(c_kv, dtype)
