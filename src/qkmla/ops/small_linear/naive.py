"""The torch references of the small-linear ops: what each of ``small_linear.cpp``'s kernels computes,
readably, and what runs wherever the kernels do not (another dtype or device, autograd, no AVX-512 BF16).

    small_linear(x, W)                     y = x W^T                      x [..., K], W [N, K] -> [..., N]
    group_statistic(x, W, kind, p, eps)    sigma_g = sigma(y_g)           x [..., K], W [G, n, K] -> [..., G]
                                           y_g = x W_g^T, group g's n outputs

Both products are PyTorch's GEMM in x's dtype: a bfloat16 one sums in float32 and rounds each output
to bfloat16 once, which is what the kernels do (their tests compare against float64 rounded once).
The statistic sigma is the QK norm's (``ops.statistic``: rms, l2, lp) over each group's outputs as
the GEMM returned them, in float32 (float64 for float64 x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..statistic import statistic


def small_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W^T, W [N, K] -> [..., N] in x's dtype."""
    return F.linear(x, w.to(x.dtype))


def group_statistic(x: torch.Tensor, w: torch.Tensor, kind: str, p: float = 2.0, eps: float = 1e-6) -> torch.Tensor:
    """The norm's statistic of each group's outputs of x W^T: x [..., K], w [G, n, K] -> [..., G]."""
    G, n, K = w.shape
    y = small_linear(x, w.reshape(G * n, K)).unflatten(-1, (G, n))  # [..., G, n], rounded as the GEMM returns it
    return statistic(y, kind, p, eps).squeeze(-1)
