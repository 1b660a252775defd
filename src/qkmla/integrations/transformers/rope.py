"""RoPE through a transformers model's own rotary embedding, for the ``rope_type`` values qkmla's
:class:`~qkmla.rope.RotaryEmbedding` does not compute ("linear", "dynamic", "longrope", "llama3", ...).

transformers' ``DeepseekV2RotaryEmbedding`` / ``DeepseekV3RotaryEmbedding`` (``model.model.rotary_emb``)
maps position ids [B, T] to cos and sin tables [B, T, d_r] (each frequency twice, NeoX halves;
V2's to one complex table [B, T, d_r/2]; its ``attention_scaling`` already applied; "dynamic" updates its frequencies from the largest
position it is given, as in transformers). :class:`TransformersRotary` reads those tables and
rotates in qkmla's layout: the interleaved pairs (x0, x1), (x2, x3), ... take frequency k from
column k of the first half, which is what transformers' ``apply_rotary_pos_emb_interleave`` does.
"""

from __future__ import annotations

import torch
from torch import nn

from ...dtypes import accumulate_dtype, cast


class TransformersRotary(nn.Module):
    """:class:`~qkmla.rope.RotaryEmbedding`'s interface (``forward(x, positions)``, ``shift``) over
    transformers' rotary embedding ``hf_rotary``, which is referenced, not registered (the model owns it).

    Args:
        hf_rotary: the model's rotary embedding module.
        interleave: True for DeepSeek's interleaved pairs, False for halves.
    """

    def __init__(self, hf_rotary: nn.Module, interleave: bool = True):
        super().__init__()
        self.__dict__["hf_rotary"] = hf_rotary  # not a submodule: no second owner, no state-dict keys
        self.interleave = interleave

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, d_r] rotated to ``positions`` [B, T] or [T], times transformers' attention scaling."""
        return self._rotate(x, positions, unscaled=False)

    def shift(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Vectors already rotated, moved by ``offsets`` [..., T] positions (no second scaling)."""
        return self._rotate(x, offsets, unscaled=True)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, unscaled: bool) -> torch.Tensor:
        acc = accumulate_dtype(x.dtype)
        ids = positions.reshape(-1, positions.shape[-1]).long()  # [B', T]: transformers takes 2-D ids
        probe = torch.empty(0, device=x.device, dtype=acc)  # transformers reads only its device and dtype
        tables = self.hf_rotary(probe, ids.to(x.device))
        half = x.shape[-1] // 2
        if isinstance(tables, torch.Tensor):  # DeepSeek-V2's: one complex table [B', T, d_r/2]
            cos, sin = tables.real.to(acc), tables.imag.to(acc)
        else:
            cos, sin = tables[0][..., :half].to(acc), tables[1][..., :half].to(acc)
        if unscaled:
            scaling = float(getattr(self.hf_rotary, "attention_scaling", 1.0))
            cos, sin = cos / scaling, sin / scaling
        cos = cos.reshape(*positions.shape, 1, half)  # [..., T, 1, d_r/2]: one angle per pair, every head
        sin = sin.reshape(*positions.shape, 1, half)
        xa = cast(x, acc)
        if self.interleave:
            x1, x2 = xa[..., 0::2], xa[..., 1::2]
            return cast(torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2), x.dtype)
        x1, x2 = xa.chunk(2, dim=-1)
        return cast(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1), x.dtype)

    def extra_repr(self) -> str:
        return f"transformers {type(self.hf_rotary).__name__} ({getattr(self.hf_rotary, 'rope_type', '?')})"


class NoRotary(nn.Module):
    """:class:`~qkmla.rope.RotaryEmbedding`'s interface for an MLA layer without RoPE (NoPE:
    Kimi-Linear's MLA layers, whose shared key part is never rotated): every vector stays as it is."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, d_r], unrotated."""
        return x

    def shift(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x, unmoved: without RoPE a key does not depend on its position."""
        return x
