"""A linear layer applied to the few rows of a decode step, spread over the CPU's threads.

torch's CPU ``F.linear`` hands a product with a handful of input rows to MKL's GEMV (or a
skinny GEMM), which runs on one thread: a decode step's projections then stream their
weights (138 MB per layer at the DeepSeek-V3 TP=8 width in float32) at one core's
memory bandwidth. Cutting the weight's output rows into one block per thread and running
the blocks as one ``bmm``, which torch parallelizes over the batch, streams them with every
core (``proj-linear`` against ``proj-split`` in benchmarks/bench_decode_parts.py).

Each output element is the same dot product as ``F.linear``'s; only the order of the
additions inside it may differ, so results agree to the dtype's roundoff. Everything else
(CUDA tensors, more rows than :data:`MAX_ROWS`, one thread, a weight whose rows split into
no 2 to ``threads`` equal blocks or that is not contiguous, a layer that is not a plain
``nn.Linear`` or has forward hooks of its own) goes through the layer or ``F.linear``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many input rows the split is faster on the 2-core CPU VM (bench_decode_parts.py
# times 1, 4 and 32 rows); with more rows MKL's GEMM threads itself and the gain fades.
MAX_ROWS = 32


def split_blocks(out_features: int, threads: int) -> int:
    """The number of row blocks: the largest divisor of out_features up to ``threads``."""
    for blocks in range(min(threads, out_features), 0, -1):
        if out_features % blocks == 0:
            return blocks
    return 1


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """``layer(x)`` for x [..., in_features] -> [..., out_features], through
    :func:`split_linear` when the layer is a plain ``nn.Linear`` without hooks."""
    if type(layer) is not nn.Linear or layer._forward_hooks or layer._forward_pre_hooks:
        return layer(x)  # a wrapped or hooked layer (LoRA, quantized, ...) keeps its own forward
    return split_linear(x, layer.weight, layer.bias)


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x [..., in] times weight [out, in] -> [..., out].

    On the CPU, for at most :data:`MAX_ROWS` rows, the weight is viewed as
    [blocks, out / blocks, in] and multiplied as one bmm; otherwise this is ``F.linear``.
    """
    out_features, in_features = weight.shape
    rows = x.numel() // in_features if in_features else 0
    blocks = split_blocks(out_features, torch.get_num_threads()) if x.device.type == "cpu" else 1
    if blocks == 1 or not 0 < rows <= MAX_ROWS or not weight.is_contiguous() or x.shape[-1] != in_features:
        return F.linear(x, weight, bias)
    x_rows = x.reshape(1, rows, in_features).expand(blocks, rows, in_features)
    y = torch.bmm(x_rows, weight.view(blocks, out_features // blocks, in_features).transpose(1, 2))
    y = y.transpose(0, 1).reshape(*x.shape[:-1], out_features)  # [blocks, rows, out/blocks] -> rows
    return y if bias is None else y + bias
