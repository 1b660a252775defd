"""The scalar statistic of the QK-norm family, sigma(v), as every kernel and layer computes it.

A member of the family is a static weight gamma and one dynamic scalar sigma(v) per vector
(``qkmla.norms``; MATH.md, "Any scalar-statistic norm absorbs"):

    rms:  sigma(v) = (sum(v²) / n + eps) ** -1/2       (RMSNorm; rho in MATH.md)
    l2:   sigma(v) = (sum(v²) + eps) ** -1/2           (Henry et al. QKNorm)
    lp:   sigma(v) = (sum(|v|^p) + eps) ** -1/p        (Lp QKNorm, p >= 1)

Each sigma is a function of one *moment* (a sum over the vector) and the vector's length n,
which is what lets the unified mode reuse the blockwise code. A moment is carried as
``scaled · 2^(q·shift)`` (:class:`Moment`): |v|^q leaves float32 for |v| > 1.8e19 at q = 2 and
for |v| > 250 at q = 16, and a sum that overflowed made sigma 0 and the normalized vector zeros.
Past the range the vector is first divided by 2^shift, shift the exponent of max|v|; inside it
shift is 0 and every value, gradients included, is the plain sum's bit for bit. This is the torch reference the
fused ops in this package match; it sits here, below them, so the ops need nothing above ``ops/``.
Statistics are computed in at least float32, whatever the input dtype.
"""

from __future__ import annotations

import math

import torch

from ..dtypes import accumulate_dtype, cast

NORM_KINDS = ("rms", "l2", "lp")  # the statistics; a QK norm's ``kind``


class Moment:
    """sum(|v|^q) over a vector's last dim as ``scaled · 2^(q·shift)``, each [..., 1]; shift is an
    integer-valued tensor of the accumulation dtype, 0 unless the plain sum would overflow."""

    __slots__ = ("scaled", "shift", "q")

    def __init__(self, scaled: torch.Tensor, shift: torch.Tensor, q: float):
        self.scaled, self.shift, self.q = scaled, shift, q

    def at(self, shift: torch.Tensor) -> torch.Tensor:
        """scaled re-expressed at a shift >= its own (the factor is exactly 1 where they are equal)."""
        return self.scaled * torch.exp2((self.shift - shift) * self.q)

    def __add__(self, other: "Moment") -> "Moment":
        """The moment of the two vectors concatenated (the unified mode's content and RoPE blocks)."""
        shift = torch.maximum(self.shift, other.shift)
        return Moment(self.at(shift) + other.at(shift), shift, self.q)

    def sum(self, dim: int) -> "Moment":
        """The moment of the vectors along ``dim`` concatenated (the projection scope's heads)."""
        shift = self.shift.amax(dim, keepdim=True)
        return Moment(self.at(shift).sum(dim, keepdim=True), shift, self.q)


def moment(v: torch.Tensor, kind: str, p: float = 2.0, eps: float = 1e-6) -> Moment:
    """sum(|v|^q) over the last dim, q = 2 for rms/l2 and p for lp. [..., n] -> [..., 1].

    ``eps``: the statistic's; with eps = 0 the sum is the whole denominator, so a vector whose sum
    would leave the normal numbers at the bottom is rescaled too (an l2 of 1e-30s gave inf). A vector
    whose largest entry is zero or subnormal has no finite sigma (1/max|v| or more is past the dtype's
    range; 0 * inf gave NaN): it is taken as the zero vector, its moment exactly 0, which
    :func:`statistic_from_moment` maps to sigma = 0 (the normalized vector 0, as ``F.normalize`` gives
    for a zero vector). A statistic with eps > 0 is bounded by eps^(-1/q) and has no such limit."""
    v = cast(v, accumulate_dtype(v.dtype))
    q = float(p) if kind == "lp" else 2.0
    # The plain sum is below n·2^(q·e) and at least 2^(q·(e-1)), e = the exponent of max|v|
    # (max|v| = m·2^e, m in [0.5, 1)).
    largest = v.detach().abs().amax(-1, keepdim=True)
    _, e = torch.frexp(largest)
    info = torch.finfo(v.dtype)
    outside = q * e > math.log2(info.max) - 1 - math.log2(v.shape[-1])
    if eps == 0:  # below: the largest term keeps its full precision
        flushed = largest < info.tiny  # zero or subnormal: the zero vector (see above)
        v = v.masked_fill(flushed, 0)
        outside = (outside | (q * (e - 1) < math.log2(info.tiny) - math.log2(info.eps))) & ~flushed
    shift = torch.where(outside, e, 0).to(v.dtype)
    # A power of two: exact, and 1 inside the range. Each operand of vecdot gets its own product, so
    # v's gradient adds up its parts in the order the plain vecdot(v, v) gives, bit for bit.
    unshift = torch.exp2(-shift)
    if kind == "lp" and p != 2:
        return Moment((v.abs() * unshift).pow(p).sum(-1, keepdim=True), shift, q)
    return Moment(torch.linalg.vecdot(v * unshift, v * unshift).unsqueeze(-1), shift, q)


def statistic_from_moment(m: Moment, n: int, kind: str, p: float, eps: float) -> torch.Tensor:
    """sigma from a moment of a vector of length n (see module docstring):
    sigma(scaled · 2^(q·shift)) = 2^-shift · sigma(scaled) with eps · 2^(-q·shift) for eps."""
    if kind not in NORM_KINDS:
        raise ValueError(f"kind: expected one of {NORM_KINDS}, got {kind!r}")
    scaled, zero = m.scaled, None
    if eps == 0:  # a zero moment (the zero vector, :func:`moment`) has sigma 0, with a finite gradient
        zero = scaled == 0
        scaled = scaled.masked_fill(zero, 1.0)
    # (eps = 0 stays 0: a vector rescaled up would make it 0 · inf)
    unshift, eps = torch.exp2(-m.shift), eps * torch.exp2(-m.q * m.shift) if eps else 0.0
    if kind == "rms":
        sigma = (scaled / n + eps).rsqrt()
    elif kind == "l2" or p == 2:
        sigma = (scaled + eps).rsqrt()
    else:
        sigma = (scaled + eps).pow(-1.0 / p)
    return (sigma if zero is None else sigma.masked_fill(zero, 0.0)) * unshift


def statistic(v: torch.Tensor, kind: str, p: float = 2.0, eps: float = 1e-6) -> torch.Tensor:
    """sigma(v) for one vector per row. [..., n] -> [..., 1], float32 or wider."""
    return statistic_from_moment(moment(v, kind, p, eps), v.shape[-1], kind, p, eps)
