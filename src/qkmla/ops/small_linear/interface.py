"""x W^T for a few rows of bfloat16 x on the CPU: ``small_linear.cpp``, with its torch reference in ``naive.py``.

A decode step multiplies a handful of new tokens by a weight; a QK-normed layer's key scalars
need every head's content key c W_UK for each new token (``attention.absorbed.key_scalars``).
At one to a few rows that product is a matrix-vector product, and oneDNN's bfloat16 GEMM (what
``F.linear`` calls on a CPU without AMX) spends more on its call and its blocking than on the
products. The kernel reads a weight packed once (:func:`pack_weight`), 64 output columns to a
tile, with AVX-512 BF16 dot products, and sums in float32 with one rounding to bfloat16 at the
end, as the GEMM does (``python -m benchmarks.bench_small_linear`` times the two side by side).
:func:`group_statistic` serves a QK norm's key scalars: the norm's statistic of each head's block
of outputs (``ops.statistic.statistic``) in one op call, with the outputs never leaving the kernel.
It reads the weight unpacked, row by row, where it lies (vLLM's W_UK is a view of
``kv_b_proj``'s weight), so the layer keeps no copy of W_UK and the query absorption that reads
the same rows next finds them in cache.

:class:`GroupedLinear` is the one object a layer holds for its W_UK: the content keys c W_UK^(g)
and their statistic, each through the kernel where it takes the inputs (over a packed copy made
once, where asked) and through ``naive.py`` elsewhere, so the math that calls it
(``attention.absorbed``) knows no kernel.

It is compiled with qkmla's other CPU kernels (``ops/cpu_extension.py``). Where it cannot run (no
AVX-512 BF16, no compiler, a weight that is not a CPU bfloat16 matrix with K even),
:func:`pack_weight` returns None (:func:`group_kernel_takes` False) and the references run.
The ops have fake implementations, so they trace under ``torch.compile``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from ..cpu_extension import build
from ..statistic import NORM_KINDS
from . import naive

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


# Rows of x up to which group_statistic runs its kernel: past them a GEMM library's blocking pays
# more than the kernel's single pass over W (bench_small_linear.py --statistic, on an AVX-512 EPYC
# without AMX: the kernel took 0.158x to 0.963x the time of F.linear and the statistic up to 16
# rows, 0.594x to 1.272x at 32). A prefill's many rows go to the reference.
GROUP_KERNEL_MAX_ROWS = 16

# Set once the kernel has built and its fakes are registered (kernel_unavailable): a plain global,
# which group_statistic reads where torch.compile traces it (the build must not be traced).
_KERNEL_READY = False


@functools.lru_cache(maxsize=None)
def kernel_unavailable() -> Optional[str]:
    """Why the kernel cannot run here, or None, with the op's fake registered once it can."""
    global _KERNEL_READY
    reason = build()
    if reason is None:
        torch.library.register_fake("qkmla_cpu::small_linear")(_fake)
        torch.library.register_fake("qkmla_cpu::group_statistic")(_fake_group_statistic)
        _KERNEL_READY = True
    return reason


def _fake(x: torch.Tensor, packed: torch.Tensor, N: int, max_rows: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], N)


def _fake_group_statistic(x: torch.Tensor, w: torch.Tensor, kind: str, p: float, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


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
    needs a gradient) goes through the reference (``naive.small_linear``) on the unpacked weight."""
    if not _kernel_takes(x):
        return naive.small_linear(x, w.unpack())
    lead, K = x.shape[:-1], x.shape[-1]
    y = torch.ops.qkmla_cpu.small_linear(x.reshape(-1, K).contiguous(), w.packed, w.N, w.max_rows)
    return y.view(*lead, w.N)


def group_kernel_takes(w: torch.Tensor) -> bool:
    """Whether :func:`group_statistic` runs the kernel over ``w`` [G, group, K]: a CPU bfloat16
    weight whose rows are contiguous (groups at any stride), on a machine where the kernel runs.

    Call it outside ``torch.compile`` (it may build the kernel), as :func:`pack_weight`."""
    return w.dim() == 3 and _group_weight_fits(w) and kernel_unavailable() is None


def _group_weight_fits(w: torch.Tensor) -> bool:
    """A weight the group kernel reads: CPU bfloat16 with contiguous rows."""
    return w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.stride(-1) == 1


def _check_group_statistic(K: int, w: torch.Tensor, kind: str, p: float) -> None:
    """The arguments of :func:`group_statistic` for x [..., K], before any work."""
    if kind not in NORM_KINDS:
        raise ValueError(f"kind: expected one of {NORM_KINDS}, got {kind!r}")
    if not p > 0:
        raise ValueError(f"p: expected p > 0, got {p}")
    if w.dim() != 3 or w.shape[-1] != K:
        raise ValueError(f"w: expected [G, group, {K}] (x's last dim), got {tuple(w.shape)}")


def group_statistic(x: torch.Tensor, w: torch.Tensor, kind: str, p: float = 2.0, eps: float = 1e-6) -> torch.Tensor:
    """A norm's statistic sigma of each group's outputs of x W^T, W given group by group (a QK
    norm's key scalar of each head for W = W_UK): x [..., K], w [G, group, K] -> [..., G], float32
    (float64 for float64 x), in one op call.

    The outputs are rounded to x's dtype first, as ``F.linear`` returns them, so this equals
    ``naive.group_statistic`` (the statistic of ``F.linear(x, w.reshape(G * group, K))`` per group) to float32
    summation order; that is also the path where the kernel does not run (another dtype, x that
    needs a gradient, more than ``GROUP_KERNEL_MAX_ROWS`` rows, a weight :func:`group_kernel_takes`
    refuses or before it has been asked).

    The kernel reads each row of w once, in place: vLLM's W_UK (a view of ``kv_b_proj``'s weight,
    each head's rows followed by its W_UV rows) needs no copy, and a decode step's query
    absorption then finds those rows in cache."""
    _check_group_statistic(x.shape[-1], w, kind, p)
    G, group, K = w.shape
    # A weight autograd records through (a decode step trained through) goes to the reference too: the kernel's
    # output carries no gradient to w. So does eps = 0: the kernel's sigma of a zero row is inf there, where the
    # reference's is 0 (ops.statistic.moment), and an inf key scalar made every logit of the token NaN.
    if not (_KERNEL_READY and _kernel_takes(x) and _group_weight_fits(w) and x.numel() <= GROUP_KERNEL_MAX_ROWS * K
            and not (torch.is_grad_enabled() and w.requires_grad) and eps > 0):
        return naive.group_statistic(x, w, kind, p, eps)
    sigma = torch.ops.qkmla_cpu.group_statistic(x.reshape(-1, K).contiguous(), w, kind, float(p), float(eps))
    return sigma.view(*x.shape[:-1], G)


def bind_group_statistic(w: torch.Tensor, kind: str, p: float = 2.0,
                         eps: float = 1e-6) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`group_statistic` over one weight and norm, its arguments checked once: x [T, K] -> [T, G].

    For a caller outside a compiled graph that runs it on every decode step (the vLLM plugin's
    cache write), where the per-call checks would cost a good part of the kernel's time. Rows
    of x that the kernel does not take (another dtype, another shape) go to :func:`group_statistic`."""
    _check_group_statistic(w.shape[-1] if w.dim() else 0, w, kind, p)
    if not group_kernel_takes(w) or not eps > 0:  # eps = 0: the reference (group_statistic)
        return functools.partial(group_statistic, w=w, kind=kind, p=p, eps=eps)
    op, p, eps = torch.ops.qkmla_cpu.group_statistic.default, float(p), float(eps)

    def bound(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= GROUP_KERNEL_MAX_ROWS and _kernel_takes(x):
            return op(x if x.stride(-1) == 1 else x.contiguous(), w, kind, p, eps)
        return group_statistic(x, w, kind, p, eps)

    return bound


class GroupedLinear:
    """A weight given group by group, w [G, n, K], as the op a decode step applies to its new tokens:
    x [..., K] -> every group's outputs x W_g^T [..., G, n] (:meth:`__call__`), or each group's norm
    statistic [..., G] (:meth:`statistic`, :meth:`bind_statistic`). A QK-normed MLA layer's W_UK
    (the content keys c W_UK^(g) and the key scalars), wherever qkmla runs it.

    ``pack=True`` packs a copy of w for :func:`small_linear` where the kernel takes it (a CPU
    bfloat16 weight on a machine where it runs): what a layer asks for when its key scalars need
    the content keys themselves (a unified norm's statistic reads the RoPE key too). Elsewhere the
    outputs come from the reference, and the statistic from :func:`group_statistic` over w where it
    lies; ``build=True`` builds that kernel now. Make it outside ``torch.compile`` (packing and
    building may compile the kernel); calling it traces.
    """

    def __init__(self, w: torch.Tensor, pack: bool = False, build: bool = False):
        self.w = w
        self.packed = pack_weight(w.reshape(-1, w.shape[-1])) if pack else None
        if build and not pack:
            group_kernel_takes(w)  # builds the statistic's kernel here, outside any compiled graph

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        G, n, K = self.w.shape
        y = small_linear(x, self.packed) if self.packed is not None else naive.small_linear(x, self.w.reshape(G * n, K))
        return y.unflatten(-1, (G, n))

    def statistic(self, x: torch.Tensor, kind: str, p: float = 2.0, eps: float = 1e-6) -> torch.Tensor:
        """:func:`group_statistic` of x over this weight: [..., K] -> [..., G]."""
        return group_statistic(x, self.w, kind, p, eps)

    def bind_statistic(self, kind: str, p: float = 2.0, eps: float = 1e-6) -> Callable[[torch.Tensor], torch.Tensor]:
        """:func:`bind_group_statistic` over this weight: x [T, K] -> [T, G], checked once."""
        return bind_group_statistic(self.w, kind, p, eps)
