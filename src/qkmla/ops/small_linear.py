"""x W^T for a few rows of bfloat16 x on the CPU: ``small_linear.cpp``, with ``F.linear`` as its reference.

A decode step multiplies a handful of new tokens by a weight; a QK-normed layer's key scalars
need every head's content key c W_UK for each new token (``attention.absorbed.key_scalars``).
At one to a few rows that product is a matrix-vector product, and oneDNN's bfloat16 GEMM (what
``F.linear`` calls on a CPU without AMX) spends more on its call and its blocking than on the
products. The kernel reads a weight packed once (:func:`pack_weight`), 64 output columns to a
tile, with AVX-512 BF16 dot products, and sums in float32 with one rounding to bfloat16 at the
end, as the GEMM does (``benchmarks/bench_small_linear.py`` times the two side by side).
:func:`small_linear_moments` goes one step further for a QK norm's key scalars: the moment of
each head's block of outputs (``qkmla.norms.moment``), with the outputs never leaving the kernel;
:func:`small_linear_statistic` one more, to the norm's statistic of each block.

It is compiled with qkmla's other CPU kernels (``cpu_extension.py``). Where it cannot run (no
AVX-512 BF16, no compiler, a weight that is not a CPU bfloat16 matrix with K even),
:func:`pack_weight` returns None and callers keep ``F.linear``. The op has a fake
implementation, so it traces under ``torch.compile`` (vLLM compiles the layer that calls it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from ..config import QK_NORMS
from ..norms import moment, statistic_from_moment
from .cpu_extension import build

TILE = 64  # output columns per packed tile (small_linear.cpp)
# Rows of x past which the product goes to a GEMM library on CPUs with AMX tiles, whose bf16
# GEMMs then outrun vdpbf16ps; without AMX the kernel keeps pace with oneDNN at every T here
# (bench_small_linear.py), so it takes them all. Not measured on an AMX machine.
MAX_ROWS_WITH_AMX = 32


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """W [N, K] packed for the kernel: ``packed`` [ceil(N / 64), K / 2, 64, 2] bf16, ``N`` its rows,
    ``max_rows`` the rows of x up to which the kernel runs (-1: all), past which a GEMM does."""

    packed: torch.Tensor
    N: int
    max_rows: int

    def unpack(self) -> torch.Tensor:
        """W [N, K] (a copy)."""
        tiles, pairs = self.packed.shape[:2]
        return self.packed.permute(0, 2, 1, 3).reshape(tiles * TILE, 2 * pairs)[:self.N]


@functools.lru_cache(maxsize=None)
def kernel_unavailable() -> Optional[str]:
    """Why the kernel cannot run here, or None, with the op's fake registered once it can."""
    reason = build()
    if reason is None:
        torch.library.register_fake("qkmla_cpu::small_linear")(_fake)
        torch.library.register_fake("qkmla_cpu::small_linear_moments")(_fake_moments)
        torch.library.register_fake("qkmla_cpu::small_linear_statistic")(_fake_statistic)
    return reason


def _fake(x: torch.Tensor, packed: torch.Tensor, N: int, max_rows: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], N)


def _fake_moments(x: torch.Tensor, packed: torch.Tensor, N: int, max_rows: int, group: int, p: float) -> torch.Tensor:
    return x.new_empty(x.shape[0], N // group, dtype=torch.float32)


def _fake_statistic(x: torch.Tensor, packed: torch.Tensor, N: int, max_rows: int, group: int, kind: str, p: float,
                    eps: float) -> torch.Tensor:
    return x.new_empty(x.shape[0], N // group, dtype=torch.float32)


def pack_weight(weight: torch.Tensor) -> Optional[PackedWeight]:
    """W [N, K] -> its packed copy for :func:`small_linear`, or None where the kernel cannot take it
    (not a CPU bfloat16 matrix with K even, or the kernel does not run on this machine).

    Call it outside ``torch.compile`` (it may build the kernel)."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.shape[1] % 2:
        return None
    if kernel_unavailable() is not None:
        return None
    N, K = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -N % TILE))
    packed = padded.view(-1, TILE, K // 2, 2).permute(0, 2, 1, 3).contiguous()
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return PackedWeight(packed, N, MAX_ROWS_WITH_AMX if amx else -1)


def _kernel_takes(x: torch.Tensor) -> bool:
    """CPU bfloat16 x outside autograd; anything else goes to the torch reference."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and not (torch.is_grad_enabled() and x.requires_grad)


def small_linear(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N], with W packed by :func:`pack_weight`.

    The kernel takes CPU bfloat16 x outside autograd; anything else (another dtype, x that
    needs a gradient) goes through ``F.linear`` on the unpacked weight, the reference."""
    if not _kernel_takes(x):
        return torch.nn.functional.linear(x, w.unpack().to(x.dtype))
    lead, K = x.shape[:-1], x.shape[-1]
    y = torch.ops.qkmla_cpu.small_linear(x.reshape(-1, K).contiguous(), w.packed, w.N, w.max_rows)
    return y.view(*lead, w.N)


def _check_groups(w: PackedWeight, group: int, p: float) -> None:
    """The arguments of a reduction over groups of outputs, before any work."""
    if group <= 0 or w.N % group:
        raise ValueError(f"group: expected a positive divisor of the weight's {w.N} rows, got {group}")
    if not p > 0:
        raise ValueError(f"p: expected p > 0, got {p}")


def small_linear_moments(x: torch.Tensor, w: PackedWeight, group: int, p: float = 2.0) -> torch.Tensor:
    """The moment sum_j |y_j|^p of each group of ``group`` consecutive outputs of y = x W^T:
    x [..., K] -> [..., N / group], float32 (float64 for float64 x).

    y is rounded to x's dtype first, as :func:`small_linear` returns it, so this equals
    ``qkmla.norms.moment(small_linear(x, w).unflatten(-1, (-1, group)), "lp", p)`` to float32
    summation order; that is also the path for inputs the kernel does not take."""
    _check_groups(w, group, p)
    if not _kernel_takes(x):
        return moment(small_linear(x, w).unflatten(-1, (-1, group)), "lp", p).squeeze(-1)
    lead, K = x.shape[:-1], x.shape[-1]
    m = torch.ops.qkmla_cpu.small_linear_moments(x.reshape(-1, K).contiguous(), w.packed, w.N, w.max_rows,
                                                 group, float(p))
    return m.view(*lead, w.N // group)


def small_linear_statistic(x: torch.Tensor, w: PackedWeight, group: int, kind: str, p: float = 2.0,
                           eps: float = 1e-6) -> torch.Tensor:
    """A norm's statistic sigma of each group of ``group`` consecutive outputs of y = x W^T (a QK
    norm's key scalar of each head, for W = W_UK): x [..., K] -> [..., N / group], float32 (float64
    for float64 x), in one op call.

    Equals ``qkmla.norms.statistic_from_moment`` of :func:`small_linear_moments` (p for "lp", 2
    otherwise) to float32 rounding; that is also the path for inputs the kernel does not take."""
    if kind not in QK_NORMS[1:]:
        raise ValueError(f"kind: expected one of {QK_NORMS[1:]}, got {kind!r}")
    q = p if kind == "lp" else 2.0
    _check_groups(w, group, q)
    if not _kernel_takes(x):
        return statistic_from_moment(small_linear_moments(x, w, group, q), group, kind, p, eps)
    lead, K = x.shape[:-1], x.shape[-1]
    sigma = torch.ops.qkmla_cpu.small_linear_statistic(x.reshape(-1, K).contiguous(), w.packed, w.N, w.max_rows,
                                                       group, kind, float(p), float(eps))
    return sigma.view(*lead, w.N // group)
