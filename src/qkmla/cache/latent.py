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
returns. Between the parts and the stored fields sits a codec (``codecs.py``: ``fields``,
``store``, ``load``) of a row format (``qkmla.kv_formats``), chosen by ``kv_format``: "dense"
(the row in ``dtype``), or a quantized latent with its scales and a bfloat16 RoPE key in one
byte row ("fp8", FlashMLA's 656-byte layout; "int8"; "int4"). The decode op reads either
through :meth:`LatentCache.decode_view`, which names the format; the key scalars are computed
from the latent as stored (:meth:`LatentCache.stored_latent`).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

from ..config import MLAConfig
from ..dtypes import cast
from ..kv_formats import DenseRows, check_kv_format, row_format
from ..utils.checked import as_int
from .base import SequenceCache, WriteSlot, check_dims, check_dtype, check_row_widths, config_fields
from .codecs import LatentCodec, QuantizedCodec
from .eviction import EvictionPolicy
from .evictor import Eviction
from .storage import Layout, PagedBuffer

__all__ = ["LatentCache", "LatentCodec", "QuantizedCodec"]


class LatentCache(SequenceCache):
    """Preallocated latent cache of one layer for ``batch_size`` sequences.

    Args:
        batch_size: B.
        capacity: most tokens per sequence.
        kv_lora_rank: d_c.
        qk_rope_head_dim: d_r.
        num_kv_groups: G scalars per token; 0 for plain MLA.
        dtype: dtype of the latent and RoPE key ("dense"); with a quantized ``kv_format``,
            the dtype :meth:`load` returns the dequantized latent in.
        scalar_dtype: dtype of the scalars (default: ``dtype``).
        layout: :class:`~qkmla.cache.storage.ContiguousLayout` (default) or ``PagedLayout``.
        fill: value of never-written slots (tests use NaN so a stray read shows); a quantized
            format takes 0 or NaN (stored as 0x00 or 0xFF bytes, read as 0 or NaN).
        kv_format: one of :data:`~qkmla.kv_formats.KV_FORMATS`: "dense" (default), "fp8"
            (float8 e4m3 latent, a float32 scale per 128 values, bfloat16 RoPE key: 656 bytes
            at d_c 512, d_r 64), "int8" (a float32 scale per token) or "int4" (two per byte,
            a float32 scale per 32 values). See ``qkmla.kv_formats``.
        policy: an :class:`~qkmla.cache.eviction.EvictionPolicy` that drops cached tokens
            (StreamingLLM, H2O, SnapKV), or None to keep every token.

    Fields: ``latent`` [B, S, d_c + d_r] in ``dtype`` ("dense") or uint8 [B, S, row bytes]
    (quantized), ``key_scale`` [B, S, G] in ``scalar_dtype``.
    """

    codec = LatentCodec()  # "dense"; another kv_format gives the cache a QuantizedCodec
    # codec: how the buffers' bytes are read (cache.codec = None failed at the next load in 'NoneType' has no 'load')
    FIXED = SequenceCache.FIXED + ("kv_lora_rank", "qk_rope_head_dim", "num_kv_groups", "dtype", "kv_format", "rows",
                                   "codec")
    READ_ONCE = ("policy", "fill", "scalar_dtype")

    def __init__(self, batch_size: int, capacity: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 num_kv_groups: int = 0, dtype: torch.dtype = torch.float32,
                 scalar_dtype: Optional[torch.dtype] = None, device=None, layout: Optional[Layout] = None,
                 fill: float = 0.0, kv_format: Union[str, DenseRows] = "dense",
                 policy: Optional[EvictionPolicy] = None):
        kv_lora_rank, qk_rope_head_dim, num_kv_groups = (as_int(v) for v in (kv_lora_rank, qk_rope_head_dim,
                                                                              num_kv_groups))
        check_dims(("num_kv_groups",), kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                   num_kv_groups=num_kv_groups)
        check_dtype("dtype", dtype)
        if scalar_dtype is not None:
            check_dtype("scalar_dtype", scalar_dtype)
        # The format is resolved to its row object here, once: the codec stores through it and the
        # decode op reads through it (decode_view hands it over).
        rows = row_format(kv_format, kv_lora_rank, qk_rope_head_dim)
        check_kv_format(rows.name, device if device is not None else "cpu")
        kv_format, latent_fill = rows.name, fill
        if rows.quantized:  # a byte row: 0x00 reads as 0 and 0xFF as NaN in every format
            if not (fill == 0 or fill != fill):  # NaN is the one value unequal to itself
                raise ValueError(f"fill: a {kv_format!r} cache fills never-written slots with 0 or NaN, got {fill!r}")
            latent_fill = 0 if fill == 0 else 0xFF
        super().__init__(batch_size, capacity, device, layout)
        # Before the buffers, whose check would name capacity: a width alone past the memory is named itself
        check_row_widths(self.batch_size, 1 if rows.quantized else dtype.itemsize, self.device,
                         kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim, num_kv_groups=num_kv_groups)
        if policy is not None:
            if self.device.type == "meta":  # its first eviction failed: "Tensor.item() cannot be called on meta ..."
                raise ValueError("policy: an eviction policy ranks the cached tokens by value, which a cache on the "
                                 "meta device (shapes only) does not hold; build it on the cpu or an accelerator")
            if getattr(policy, "reposition", False) and (rows.quantized or dtype.itemsize < 4):
                # Every eviction re-rotates and re-stores the kept RoPE keys; rounded to 16
                # bits each time, the error accumulates (2.6% after 600 steps in bf16).
                raise ValueError(f"policy: reposition=True re-rotates the stored RoPE keys at every eviction, which "
                                 f"needs them in float32 or wider; this cache stores them in "
                                 f"{'bfloat16' if rows.quantized else dtype} (kv_format={kv_format!r}). Use "
                                 f"a float32 dense cache or reposition=False")
            object.__setattr__(self, "eviction", Eviction(policy, batch_size, self.device))  # FIXED once set
        self.kv_lora_rank, self.qk_rope_head_dim, self.num_kv_groups = kv_lora_rank, qk_rope_head_dim, num_kv_groups
        self.rows, self.kv_format, self.dtype = rows, kv_format, dtype
        self.codec = QuantizedCodec(rows) if rows.quantized else type(self).codec  # the instance's own: FIXED
        for name, (width, field_dtype) in self.codec.fields(kv_lora_rank, qk_rope_head_dim, num_kv_groups, dtype,
                                                            scalar_dtype or dtype).items():
            self._add_field(name, width, field_dtype, latent_fill if name == "latent" else fill)

    def append(self, slot: WriteSlot, *, c_kv: torch.Tensor, k_rope: torch.Tensor,
               key_scale: Optional[torch.Tensor] = None) -> None:
        """Store the new tokens' rows at ``slot`` (from :meth:`plan`): c [B, T, d_c], the
        normalized, rotated RoPE key k^R [B, T, d_r] and, with a QK norm, the key scalars
        r [B, T, G]."""
        B, T = slot.slots.shape
        want = {"c_kv": (c_kv, self.kv_lora_rank), "k_rope": (k_rope, self.qk_rope_head_dim),
                "key_scale": (key_scale, self.num_kv_groups)}
        stored = {**self.rows.part_dtypes(self.dtype), "key_scale": self.stored_dtype("key_scale")}
        for name, (t, width) in want.items():
            if width == 0 and t is None:
                continue
            self.check_rows(name, t, (B, T, width), stored=stored[name])
        self.write_rows(slot, self.codec.store(c_kv, k_rope, key_scale))

    def load(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Every sequence's first max(seqlens) slots: (latent [B, S, d_c + d_r], key scalars
        [B, S, G] or None), slots past a shorter sequence's length zeroed; a quantized latent
        comes back dequantized, in ``dtype``."""
        latent, key_scale = self.codec.load({name: self.read(name) for name in self.fields})
        return cast(latent, self.dtype), key_scale

    def stored_latent(self, c_kv: torch.Tensor) -> torch.Tensor:
        """c [..., d_c] as this cache reads it back: rounded to ``dtype`` ("dense"), or
        quantized and dequantized. The key scalars of a new token are computed from it, so a
        cached key is the normalized key of the latent the decoder sees."""
        return self.codec.stored_latent(c_kv, self.dtype)

    def decode_view(self) -> dict:
        """What the decode op (``qkmla.ops.mla_decode.mla_decode_with_kvcache``) reads, by its
        argument names: ``kv_cache`` [num_blocks, block_size, width] with ``block_table``
        [B, max_blocks] (paged), or [B, capacity, width] with ``block_table=None``
        (contiguous), width d_c + d_r ("dense") or the quantized row's bytes; ``kv_format``, the
        row format object (``qkmla.kv_formats``) the cache resolved when it was built;
        ``scale_cache`` of the same layout with width G, or None; ``cache_seqlens`` [B];
        ``max_seqlen`` (a Python int)."""
        latent = self.fields["latent"]
        scales = self.fields.get("key_scale")
        if isinstance(latent, PagedBuffer):
            kv, s, table = latent.pool, scales.pool if scales is not None else None, latent.block_table
        else:
            kv, s, table = latent.data, scales.data if scales is not None else None, None
        return dict(kv_cache=kv, scale_cache=s, block_table=table, cache_seqlens=self.seqlens, max_seqlen=self.max_len,
                    kv_format=self.rows)

    def check_config(self, config: MLAConfig) -> None:
        """Raise ValueError unless this cache holds the rows of a layer built from ``config``."""
        want = (config.kv_lora_rank, config.qk_rope_head_dim, config.num_key_scalars)
        got = (self.kv_lora_rank, self.qk_rope_head_dim, self.num_kv_groups)
        if got != want:
            raise ValueError(f"cache: LatentCache(kv_lora_rank, qk_rope_head_dim, num_kv_groups)={got} does not match "
                             f"this layer, which needs {want}; build it with LatentCache.from_config(config, ...)")

    @classmethod
    def from_config(cls, config: MLAConfig, batch_size: int, capacity: int, **kwargs) -> "LatentCache":
        """A cache shaped for ``config``: scalars only when it has a QK norm (``config.num_key_scalars``)."""
        shape = config_fields(config, ("kv_lora_rank", "qk_rope_head_dim", "num_key_scalars"), "an MLAConfig")
        return cls(batch_size, capacity, *shape, **kwargs)

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
