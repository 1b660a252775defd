"""A sparse decode's selection, packed for the fast paths (the rule itself: ``naive.py``).

The torch backend and the CPU kernel read each query's selected slots as a prefix: the entries of
``indices`` that select a slot (``naive.selected_slots``) moved to the front in the order listed,
and their count, which then plays the part a query's visible length plays in a dense decode.
"""

from __future__ import annotations

from typing import Optional

import torch

from .naive import selected_slots


def packed_selection(indices: torch.Tensor, topk_length: Optional[torch.Tensor],
                     cache_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [B, S_q, topk] int64, counts [B, S_q] int64): each query's selected slots first,
    in the order listed, then zeros (slot 0, a position safe to read); counts of them."""
    slots, selected = selected_slots(indices, topk_length, cache_seqlens)
    # A stable sort of "not selected" moves the selected entries to the front, keeping their order.
    order = torch.sort((~selected).to(torch.uint8), dim=-1, stable=True).indices
    return slots.gather(-1, order).contiguous(), selected.sum(dim=-1)
