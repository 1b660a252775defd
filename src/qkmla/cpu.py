"""CPU decoding, opt-in: the few-row projections of a decode step spread over the CPU's threads.

``optimize_for_decode(model)`` swaps every plain ``nn.Linear`` of ``model`` for a
:class:`DecodeLinear`, which shares its parameters (state dict, optimizer and checkpoints
see no difference) and, in eval mode only, runs products of at most :data:`MAX_ROWS` rows
through :func:`split_linear`. Training (``model.train()``) and every larger product go
through ``F.linear`` as before. Nothing in the model code depends on it.

Why: torch's CPU ``F.linear`` hands a product with a handful of input rows to MKL's GEMV (or a
skinny GEMM), which may run it on one thread: a decode step's projections then stream their
weights (138 MB per layer at the DeepSeek-V3 TP=8 width in float32) at one core's memory
bandwidth. Cutting the weight's output rows into one block per thread and running the
blocks as one ``bmm``, which torch parallelizes over the batch, streams them with every
core (``proj-linear`` against ``proj-split`` in benchmarks/bench_decode_parts.py). Whether
that pays depends on the machine: benchmarks/README.md has one where the split is faster
(a 2-core AMD EPYC) and one where ``F.linear`` alone is faster for one row (a 2-core Intel
Xeon), hence an opt-in.

Each output element is the same dot product as ``F.linear``'s; only the order of the
additions inside it may differ, so results agree to the dtype's roundoff. Everything else
(CUDA tensors, more rows than :data:`MAX_ROWS`, one thread, a weight whose rows split into
no 2 to ``threads`` equal blocks or that is not contiguous) goes through ``F.linear``; a
layer that is not a plain ``nn.Linear`` or has forward hooks of its own is not swapped.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# Products of up to this many rows (a decode step's) are split; larger ones (prefill, big
# batches) keep F.linear's threaded GEMM (benchmarks/bench_decode_parts.py times 1, 4 and 32 rows).
MAX_ROWS = 32


def split_blocks(out_features: int, threads: int) -> int:
    """The number of row blocks: the largest divisor of out_features up to ``threads``."""
    for blocks in range(min(threads, out_features), 0, -1):
        if out_features % blocks == 0:
            return blocks
    return 1


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 blocks: Optional[int] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., in] times weight [out, in] -> [..., out].

    On the CPU, for at most :data:`MAX_ROWS` rows, the weight is viewed as
    [blocks, out / blocks, in] and multiplied as one bmm; otherwise this is ``F.linear``.
    ``blocks``: the number of row blocks (it must divide out); None picks
    ``split_blocks(out, torch.get_num_threads())``. A fixed number keeps the function free
    of host calls, so ``torch.compile(fullgraph=True)`` can trace it.
    """
    out_features, in_features = weight.shape
    rows = x.numel() // in_features if in_features else 0
    if blocks is None:
        blocks = split_blocks(out_features, torch.get_num_threads())
    if x.device.type != "cpu" or blocks <= 1 or out_features % blocks or not 0 < rows <= MAX_ROWS \
            or not weight.is_contiguous() or x.shape[-1] != in_features:
        return F.linear(x, weight, bias)
    # Under torch.compile the product is one opaque op (it has no backward, so only without
    # autograd): inductor would otherwise rewrite the few-row bmm into its own loop.
    recording = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    matmul = torch.ops.qkmla.split_matmul if torch.compiler.is_compiling() and not recording else _split_matmul
    y = matmul(x.reshape(rows, in_features), weight, blocks).view(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


def _split_matmul(x: torch.Tensor, weight: torch.Tensor, blocks: int) -> torch.Tensor:
    """x [rows, in] @ weight[out, in].T -> [rows, out], as ``blocks`` row blocks in one bmm."""
    rows, in_features = x.shape
    out_features = weight.shape[0]
    x_rows = x.unsqueeze(0).expand(blocks, rows, in_features)
    y = torch.bmm(x_rows, weight.view(blocks, out_features // blocks, in_features).transpose(1, 2))
    return y.transpose(0, 1).reshape(rows, out_features)  # [blocks, rows, out/blocks] -> rows


@torch.library.custom_op("qkmla::split_matmul", mutates_args=())
def _split_matmul_op(x: torch.Tensor, weight: torch.Tensor, blocks: int) -> torch.Tensor:
    return _split_matmul(x, weight, blocks)


@_split_matmul_op.register_fake
def _(x, weight, blocks):
    return x.new_empty(x.shape[0], weight.shape[0])


class DecodeLinear(nn.Linear):
    """``nn.Linear`` whose eval-mode forward goes through :func:`split_linear` (see the module
    docstring) with ``blocks`` row blocks, fixed when the layer is made."""

    blocks: int = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:  # training never takes the split
            return F.linear(x, self.weight, self.bias)
        return split_linear(x, self.weight, self.bias, self.blocks)


def optimize_for_decode(model: nn.Module, threads: Optional[int] = None) -> nn.Module:
    """Swap every plain, hook-free ``nn.Linear`` in ``model`` for a :class:`DecodeLinear`
    holding the same parameters; returns ``model``. Wrapped or hooked layers (LoRA,
    quantized, ...) keep their own forward.

    ``threads``: the threads each projection is spread over (default: torch's thread count
    now). It is fixed here rather than read at every call, so a compiled decode step
    (``torch.compile(fullgraph=True)``) can run the swapped layers: call this again after
    ``torch.set_num_threads``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected an nn.Module, got {type(model).__name__}")
    if threads is None:
        threads = torch.get_num_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads: expected a positive int, got {threads!r}")
    for parent in list(model.modules()):
        for name, layer in list(parent.named_children()):
            if type(layer) is DecodeLinear:  # swapped before: take the new thread count
                layer.blocks = split_blocks(layer.out_features, threads)
                continue
            if type(layer) is not nn.Linear or layer._forward_hooks or layer._forward_pre_hooks:
                continue
            swapped = DecodeLinear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
            swapped.weight, swapped.bias = layer.weight, layer.bias
            swapped.blocks = split_blocks(layer.out_features, threads)
            swapped.train(layer.training)
            setattr(parent, name, swapped)
    return model
