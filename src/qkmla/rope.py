"""Rotary position embedding (Su et al.), in DeepSeek's interleaved or the NeoX half layout.

The angle of pair k at position t is t * theta ** (-2k / dim). Interleaved rotates pairs
(x0, x1), (x2, x3), ... as DeepSeek-V2/V3 checkpoints expect; the half layout rotates
(x_k, x_{k + dim/2}) as Llama/NeoX do. The rotation is computed in at least float32.
"""

from __future__ import annotations

import torch
from torch import nn

from .dtypes import accumulate_dtype, cast


class RotaryEmbedding(nn.Module):
    """Applies RoPE to x [..., T, H, dim] at integer positions [..., T].

    Args:
        dim: rotated width (even).
        theta: base of the frequencies.
        interleave: True for pairs (x0, x1), False for halves.
    """

    def __init__(self, dim: int, theta: float = 10000.0, interleave: bool = True):
        super().__init__()
        if dim % 2:
            raise ValueError(f"dim: RoPE rotates pairs, so it must be even, got {dim}")
        self.dim, self.theta, self.interleave = dim, float(theta), interleave
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        # Kept in float64 and cast per call, so float64 verification is not limited by it.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        acc = accumulate_dtype(x.dtype)
        angles = positions.to(acc)[..., None, None] * cast(self.inv_freq, acc)  # [..., T, 1, dim/2]
        xa = cast(x, acc)
        if self.interleave:
            # Pairs (x0, x1) as complex numbers x0 + i x1, rotated by e^(i angle): one complex
            # product in place of a dozen real ops (DeepSeek's reference code does the same).
            pairs = torch.view_as_complex(xa.unflatten(-1, (-1, 2)).contiguous())
            out = torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
            return cast(out, x.dtype)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = xa.chunk(2, dim=-1)
        return cast(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1), x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, theta={self.theta:g}, interleave={self.interleave}"
