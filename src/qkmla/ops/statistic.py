"""The scalar statistic of the QK-norm family, sigma(v), as every kernel and layer computes it.

A member of the family is a static weight gamma and one dynamic scalar sigma(v) per vector
(``qkmla.norms``; MATH.md, "Any scalar-statistic norm absorbs"):

    rms:  sigma(v) = (sum(v²) / n + eps) ** -1/2       (RMSNorm; rho in MATH.md)
    l2:   sigma(v) = (sum(v²) + eps) ** -1/2           (Henry et al. QKNorm)
    lp:   sigma(v) = (sum(|v|^p) + eps) ** -1/p        (Lp QKNorm, p >= 1)

Each sigma is a function of one *moment* (a sum over the vector) and the vector's length n,
which is what lets the unified mode reuse the blockwise code. This is the torch reference the
fused ops in this package match; it sits here, below them, so the ops need nothing above ``ops/``.
Statistics are computed in at least float32, whatever the input dtype.
"""

from __future__ import annotations

import torch

from ..dtypes import accumulate_dtype, cast

NORM_KINDS = ("rms", "l2", "lp")  # the statistics; a QK norm's ``kind``


def moment(v: torch.Tensor, kind: str, p: float = 2.0) -> torch.Tensor:
    """sum(|v|^q) over the last dim, q = 2 for rms/l2 and p for lp. [..., n] -> [..., 1]."""
    v = cast(v, accumulate_dtype(v.dtype))
    if kind == "lp" and p != 2:
        return v.abs().pow(p).sum(-1, keepdim=True)
    return torch.linalg.vecdot(v, v).unsqueeze(-1)


def statistic_from_moment(m: torch.Tensor, n: int, kind: str, p: float, eps: float) -> torch.Tensor:
    """sigma from a moment of a vector of length n (see module docstring)."""
    if kind == "rms":
        return (m / n + eps).rsqrt()
    if kind == "l2" or (kind == "lp" and p == 2):
        return (m + eps).rsqrt()
    if kind == "lp":
        return (m + eps).pow(-1.0 / p)
    raise ValueError(f"kind: expected one of {NORM_KINDS}, got {kind!r}")


def statistic(v: torch.Tensor, kind: str, p: float = 2.0, eps: float = 1e-6) -> torch.Tensor:
    """sigma(v) for one vector per row. [..., n] -> [..., 1], float32 or wider."""
    return statistic_from_moment(moment(v, kind, p), v.shape[-1], kind, p, eps)
