"""The ``"cpu"`` backend of the MLA decode op: a fused C++ kernel over a paged bfloat16 cache.

``cpu_kernel.cpp`` reads every visible row once, straight from its block, and multiplies the key
scalars into each chunk's score tile before the online softmax (what the Triton kernel does on a
GPU), on AVX-512 BF16 dot products. The torch backend instead gathers each chunk's rows into
contiguous buffers for its GEMMs and reads the scalars in passes of their own; here a QK-normed
decode costs plain MLA's pass plus the scalars' bytes and one multiply per score.

The kernel is compiled on first use, with qkmla's other CPU kernels (``ops/cpu_extension.py``:
a C++ compiler and ninja on the machine, 9 s here, then cached). :func:`cpu_unsupported` says
why it cannot run (no AVX-512 BF16, no compiler, an input it does not take); ``"auto"`` then
keeps the torch backend (a failed build is reported once, as a warning). ``QKMLA_CPU_KERNEL=0``
turns the kernels off.

What it takes: bfloat16 queries and dense bfloat16 rows with contiguous channels (the cache's
own tensor or a column view of wider rows, as vLLM's), key scalars in bfloat16 or float32 at any
row stride, d_c a multiple of 32, d_r even, any head count and G dividing it, S_q >= 1. A sparse
decode (``indices``) hands it each query's selected slots packed to the front
(``selection.packed_selection``) with their count as the query's visible keys: the kernel reads key k
of a query from slot slots[b, t, k] instead of slot k, the row and its key scalars alike.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..cpu_extension import build

MODE_CODES = {"plain": 0, "blockwise": 1, "unified": 2}
# "auto" takes the kernel up to this many query heads per sequence (S_q x H): it reads the keys
# once per query token, where the torch backend's GEMMs take every query head of a sequence at
# once, so past this the GEMMs are not reliably slower (python -m benchmarks.bench_cpu_kernel).
AUTO_MAX_QUERY_HEADS = 32
MIN_KEYS_PER_SPLIT = 512  # below this a split's merge costs more than its parallelism gains


def cpu_unsupported_for(device, d_c: int, d_r: int, dtype: Optional[torch.dtype] = None,
                        quantized: bool = False) -> Optional[str]:
    """Why the CPU kernel cannot decode on ``device`` at these widths, dtype (None: not checked)
    and rows (``quantized``: a quantized row format's bytes) (a message naming the argument), or
    None. The cheap checks come first, so an input the kernel does not take never triggers the build."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"backend: 'cpu' runs on CPU tensors, got {device.type} tensors; use 'torch' or 'auto'"
    if quantized or (dtype is not None and dtype != torch.bfloat16):
        return (f"kv_cache, q_lat: the CPU kernel reads dense bfloat16 rows with bfloat16 queries, got "
                f"{'quantized' if quantized else 'dense'} rows{'' if dtype is None else f', {dtype} queries'}; "
                f"use 'torch' or 'auto'")
    if d_c % 32 or d_r % 2:
        return f"q_lat, q_rope: the CPU kernel needs d_c a multiple of 32 and d_r even, got {d_c}, {d_r}"
    reason = build()
    return None if reason is None else f"backend: {reason}; use 'torch' or 'auto'"


def cpu_unsupported(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                    scale_cache: Optional[torch.Tensor], softmax_scale,
                    written: Optional[dict] = None) -> Optional[str]:
    """What :func:`cpu_unsupported_for` (which ``select_backend`` has asked already, with these
    tensors' device, widths, dtype and format, so the rows are dense) could not see: the cache's
    dtype and strides, the scalars' dtype, autograd. ``written``: rows (name -> tensor) that will
    be written into the cache before the call, so their autograd is the cache's. A message naming
    the argument, or None."""
    if kv_cache.dtype != torch.bfloat16:
        return f"kv_cache: the CPU kernel reads dense bfloat16 rows, got {kv_cache.dtype}; use 'torch' or 'auto'"
    if kv_cache.stride(-1) != 1:
        return "kv_cache: the CPU kernel needs each row's channels contiguous; use 'torch' or 'auto'"
    if scale_cache is not None and scale_cache.shape[-1] > 1 and scale_cache.stride(-1) != 1:
        return "scale_cache: the CPU kernel needs each row's G scalars contiguous; use 'torch' or 'auto'"
    if scale_cache is not None and scale_cache.dtype not in (torch.bfloat16, torch.float32):
        return (f"scale_cache: the CPU kernel reads bfloat16 or float32 key scalars, got {scale_cache.dtype}; "
                f"use 'torch' or 'auto'")
    if torch.is_grad_enabled():
        tracked = [name for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("kv_cache", kv_cache),
                                        ("scale_cache", scale_cache), ("softmax_scale", softmax_scale),
                                        *(written or {}).items())
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tracked:
            return (f"{', '.join(tracked)}: the CPU kernel is not differentiable; decode under torch.no_grad() "
                    f"or use 'torch'")
    return None


def _splits(queries: int, longest: int) -> int:
    """Key splits per query so that every thread has work, none shorter than MIN_KEYS_PER_SPLIT."""
    threads = torch.get_num_threads()
    if queries >= threads:
        return 1
    return max(1, min(-(-2 * threads // queries), longest // MIN_KEYS_PER_SPLIT))


def cpu_mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: Optional[torch.Tensor], visible: torch.Tensor, scale_cache: Optional[torch.Tensor],
                   softmax_scale: float, mode: str,
                   slots: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's CPU kernel (inputs already checked, :func:`cpu_unsupported` None).

    Args:
        q_lat: [B, S_q, H, d_c] bf16; q_rope: [B, S_q, H, d_r] bf16.
        kv_cache: [num_blocks, block_size, d_c + d_r] bf16 rows (channels contiguous), or
            [B, capacity, d_c + d_r] with ``block_table`` None.
        visible: [B, S_q] keys each query sees, already capped at its sequence's length.
        scale_cache: [num_blocks, block_size, G] key scalars, or None for plain MLA.
        mode: "blockwise" or "unified" (ignored without key scalars).
        slots: [B, S_q, topk] int64, a sparse decode: key k < visible[b, t] of query (b, t) is
            slot slots[b, t, k] (each below its sequence's length, ``selection.packed_selection``);
            None: key k is slot k.

    Returns:
        out [B, S_q, H, d_c] bf16, lse [B, S_q, H] float32 (-inf, out 0, where no key is visible).
    """
    reason = build()
    if reason is not None:
        raise ValueError(f"backend: {reason}; use 'torch' or 'auto'")
    B, S_q, H, d_c = q_lat.shape
    if block_table is None:  # a contiguous cache is one block per sequence
        block_table = torch.arange(B, dtype=torch.int32)[:, None]
    q = torch.cat((q_lat, q_rope), dim=-1).contiguous()
    visible = visible.to(torch.int64).contiguous()
    longest = int(visible.max()) if visible.numel() else 0
    code = 0 if scale_cache is None else MODE_CODES[mode]
    if slots is not None:
        slots = slots.to(torch.int64).contiguous()
    return torch.ops.qkmla_cpu.mla_decode(q, kv_cache, scale_cache, block_table.to(torch.int32).contiguous(), visible,
                                          d_c, float(softmax_scale), code, _splits(B * S_q, longest), slots)
