"""A sparse (top-k) attention's selection, as the explicit paths read it.

DeepSeek's sparse attention (DSA: a lightning indexer picks each query's top-k keys) hands
attention a selection ``indices`` [B, T, topk]: for new token t of sequence b, the cache slots it
attends to, -1 for none. The absorbed decode reads exactly those rows (the decode op's
``indices``, ``qkmla.ops.mla_decode.naive`` draws the rule); the explicit paths, which materialize
every key, mask the others out with :func:`selection_mask`.
"""

from __future__ import annotations


import torch


def check_selection(indices, x: torch.Tensor, cache) -> None:
    """A ValueError naming ``indices`` unless it is an int tensor [B, T, topk >= 1] on x's device
    given with a latent cache; its values are not read here (no device-to-host sync)."""
    from ..cache.latent import LatentCache

    B, T = x.shape[:2]
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64) \
            or indices.dim() != 3 or tuple(indices.shape[:2]) != (B, T) or indices.shape[2] < 1:
        got = f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"indices: expected an int32/int64 tensor [B={B}, T={T}, topk >= 1] of the cache slots each "
                         f"new token attends to (-1 for none), got {got}")
    if indices.device != x.device:
        raise ValueError(f"indices: expected a tensor on x's device ({x.device}), got {indices.device}")
    if not isinstance(cache, LatentCache):
        raise ValueError(f"indices: a sparse selection names latent cache slots; pass a LatentCache, got "
                         f"{type(cache).__name__}")


def selection_mask(indices: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[B, T, num_slots] bool, True at the slots ``indices`` [B, T, topk] selects; entries
    outside [0, num_slots) (-1 among them) select nothing, as in the decode op."""
    B, T, _ = indices.shape
    inside = (indices >= 0) & (indices < num_slots)
    # Entries that select nothing go to an extra column, dropped after the scatter.
    columns = torch.where(inside, indices.long(), num_slots)
    mask = torch.zeros(B, T, num_slots + 1, dtype=torch.bool, device=indices.device)
    return mask.scatter_(-1, columns, True)[..., :num_slots]
