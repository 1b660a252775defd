"""Scratch buffers the torch backend reuses from one decode call to the next.

A paged decode reads its cache a chunk of blocks at a time into a few buffers of megabytes
(the chunk's rows, its content and RoPE blocks). On the CPU a fresh buffer of that size is
mapped from the operating system and given back when freed (glibc's allocator does so for
blocks past its mmap and trim thresholds), so every call faults the same memory in again,
a page at a time. A serving engine calls the op once per layer and step, with the same
shapes, so the buffers are kept between calls instead.

CUDA's caching allocator already keeps freed blocks: buffers are kept on the CPU only. Each
thread has its own (a buffer in use by one call is never handed to another), a buffer grows to
the largest request, and a request over :data:`MAX_KEPT_BYTES` is allocated fresh and not
kept. Under tracing (``torch.compile``) every request is fresh. Buffers are made outside
inference mode, so a thread that decodes under ``torch.inference_mode`` and later under
``no_grad`` (generation, then evaluation) can write into them both times. The decode op is not
differentiable (its softmax runs in place): an autograd graph recorded through it may hold
views of a kept buffer, but no backward through it runs.
"""

from __future__ import annotations

import math
import threading

import torch

MAX_KEPT_BYTES = 64 << 20  # past this a request is allocated fresh: a rare huge batch should not pin its memory

_local = threading.local()


def scratch(role: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialized contiguous tensor of ``shape``: on the CPU the same memory on every call
    with the same ``role``, dtype and device from this thread, while it fits."""
    numel, device = math.prod(shape), torch.device(device)
    if device.type != "cpu" or numel * dtype.itemsize > MAX_KEPT_BYTES or torch.compiler.is_compiling():
        return torch.empty(shape, dtype=dtype, device=device)
    kept = _local.__dict__.setdefault("buffers", {})
    key = (role, dtype, device)
    if key not in kept or kept[key].numel() < numel:
        with torch.inference_mode(False):  # an inference tensor refuses writes outside inference mode
            kept[key] = torch.empty(numel, dtype=dtype, device=device)
    return kept[key][:numel].view(shape)


def release() -> None:
    """Free this thread's kept buffers (the next call allocates them again)."""
    _local.__dict__.pop("buffers", None)
