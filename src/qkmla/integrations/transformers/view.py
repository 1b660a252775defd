"""A latent cache layer's ``keys`` and ``values`` in transformers' layout, computed when read.

transformers' cache layers hold the keys and values its attention wrote, ``keys`` [B, h, K, d_n + d_r]
and ``values`` [B, h, K, d_v] over the K columns, and code that inspects a cache (its own tests'
``_check_past_key_values_for_generate``, tools that read or edit a cache) reads them there. A
latent layer holds the latent rows instead (MATH.md: c, the rotated RoPE key, the key scalars),
and what transformers' own DeepSeek attention caches depends on its version:

    "expanded" (before 5.15: no ``expand_kv`` on its attention class), one entry per head,
        keys[b, i, s]   = [ W_UK^(g(i)) c_s ; k^R_s ]  (normalized as the layer normalizes them)
        values[b, i, s] = W_UV^(g(i)) c_s
    "latent" (``expand_kv`` present: it caches MLA's compressed rows, as a single head)
        keys[b, 0, s]   = c_s        values[b, 0, s] = k^R_s

DeepSeek-V3's attention rotates DeepSeek's interleaved RoPE pairs (x0, x1), (x2, x3), ... by first
moving them to halves (x0, x2, ..., x1, x3, ...), and caches k^R so; the view does the same
(``LatentAttention.hf_rope_halves``), so every entry is transformers' own.

:class:`TransformersView` gives the layers these two attributes in the installed version's layout
(``LatentAttention.hf_cache_layout``), computed from the rows on every read (nothing is stored; an
"expanded" read costs one up-projection of the whole cache, which decoding never does), padding
columns zero. They are a view: they cannot be assigned. Before the layer's first forward, or once
the layer that wrote it is gone, they are None, as an empty transformers layer's are.

The layer finds its attention through :class:`AttentionReference`, a weak reference that copies
share and pickle leaves out: a cache is saved (``torch.save``) without the model, and the first
forward after loading sets it again.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch


class AttentionReference:
    """A weak reference to the attention layer that writes a cache layer (module docstring).

    ``copy.copy`` and ``copy.deepcopy`` of a cache (transformers' recipe for reusing a prompt's cache)
    share it, as they share a plain ``weakref.ref``; pickle, which cannot hold a weak reference, writes None in its
    place, and the layer's next forward sets it again.
    """

    __slots__ = ("_ref",)

    def __init__(self, attention: torch.nn.Module):
        self._ref = weakref.ref(attention)

    def __call__(self) -> Optional[torch.nn.Module]:
        return self._ref()

    def __copy__(self) -> "AttentionReference":
        return self

    def __deepcopy__(self, memo) -> "AttentionReference":
        return self

    def __reduce__(self):
        return type(None), ()


class TransformersView:
    """``keys`` / ``values`` of a latent cache layer (module docstring). A layer using it provides
    :meth:`rows_by_column`; the attention layer that writes it sets :attr:`attention`."""

    attention: Optional[AttentionReference] = None

    def rows_by_column(self) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """(latent rows [B, K, d_c + d_r], key scalars [B, K, G] or None, which columns hold a token [B, K])."""
        raise NotImplementedError

    @property
    def keys(self) -> Optional[torch.Tensor]:
        """[B, h, K, d_n + d_r], transformers' layout (module docstring), or None."""
        return self._expanded(0)

    @keys.setter
    def keys(self, value) -> None:
        _read_only("keys", value)

    @property
    def values(self) -> Optional[torch.Tensor]:
        """[B, h, K, d_v], transformers' layout (module docstring), or None."""
        return self._expanded(1)

    @values.setter
    def values(self, value) -> None:
        _read_only("values", value)

    @torch.no_grad()
    def _expanded(self, which: int) -> Optional[torch.Tensor]:
        attn = self.attention() if self.attention is not None else None
        if attn is None or not getattr(self, "is_initialized", False):
            return None
        latent, key_scale, filled = self.rows_by_column()
        c = attn.config
        if getattr(attn, "hf_rope_halves", False) and c.rope_interleave:  # pairs to halves, as V3 caches them
            d_r = c.qk_rope_head_dim
            rope = latent[..., -d_r:].unflatten(-1, (d_r // 2, 2)).transpose(-1, -2).flatten(-2)
            latent = torch.cat((latent[..., :-d_r], rope), dim=-1)
        if getattr(attn, "hf_cache_layout", "expanded") == "latent":
            rows = latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)[which]
            return (rows * filled[..., None].to(rows.dtype))[:, None]  # [B, 1, K, d_c or d_r]
        expanded = attn.expand_cache(latent, key_scale)[which]  # [B, K, G, width]
        expanded = expanded * filled[:, :, None, None].to(expanded.dtype)
        repeats = attn.config.num_heads // expanded.shape[2]
        if repeats > 1:
            expanded = expanded.repeat_interleave(repeats, dim=2)
        return expanded.transpose(1, 2)


def _read_only(name: str, value) -> None:
    if value is not None:  # transformers' CacheLayerMixin.__init__ sets both to None
        raise ValueError(f"cache: a latent cache layer's {name} are computed from its latent rows when read; they "
                         f"cannot be assigned (write through the patched model's forward)")
