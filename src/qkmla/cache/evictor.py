"""An eviction policy at work on one latent cache, and StreamingLLM's re-positioning.

The attention layer calls ``LatentCache.after_attention`` once per forward that wrote the
cache, after attending; a cache built with a policy hands the call to its :class:`Eviction`:

    forward writes T tokens ──> attention over the cache ──> after_attention(layer, slot, queries)
                                                               │ policy reads attention? score the slots
                                                               │ prefill, or every `interval` steps?
                                                               └─> keep_mask ─> cache.keep ─> (reposition)

Without a policy the cache returns at once: no query is formed, nothing is scored.

Everything that may fail runs before the first row moves: the scores, the compacted scores
and the re-positioned RoPE keys are computed against the cache as it is (``cache.keep_order``
says where each row will go), then ``cache.apply_keep`` moves the rows, the turned keys are
written and the policy's state is committed. A failure before the move (inside the layer's
``cache.transaction()``) leaves the scores, the step count and the cache as they were, and
the transaction takes the new tokens out again.
"""

from __future__ import annotations

from typing import Callable

import torch

from .eviction import EvictionPolicy
from .scores import attention_received


class Eviction:
    """A policy's state on one cache of B sequences: decode steps since the last reset, per-head
    scores [B, h, S] (or None), and the tokens each sequence has had evicted [B]."""

    def __init__(self, policy: EvictionPolicy, batch_size: int, device):
        if not isinstance(policy, EvictionPolicy):
            raise ValueError(f"policy: expected an EvictionPolicy (StreamingLLM, H2O, SnapKV, or "
                             f"make_policy(name, ...)) or None, got {policy!r:.80}")
        self.policy, self.batch_size, self.device = policy, batch_size, device
        self.reset()

    def reset(self) -> None:
        self.steps, self.scores = 0, None
        self.evicted = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)

    def select(self, indices: torch.Tensor) -> None:
        """Follow the cache's ``select_sequences``: keep sequences ``indices`` [B'] in that order."""
        self.scores = self.scores[indices] if self.scores is not None else None
        self.evicted, self.batch_size = self.evicted[indices], len(indices)

    @torch.no_grad()
    def after_attention(self, cache, layer, slot, queries: Callable[[], tuple]) -> None:
        """Observe the forward that wrote ``slot`` and evict if one is due (see
        ``LatentCache.after_attention`` for the arguments)."""
        policy = self.policy
        prefill = slot.slots.shape[1] > 1
        steps, scores, evicted = self.steps + (not prefill), self.scores, self.evicted
        observed = policy.observed(slot, prefill)
        if observed is not None:
            latent, key_scale = cache.load()
            received = attention_received(latent, key_scale, slot, observed, *queries(), layer.scale, layer.score_mode)
            scores = policy.accumulate(scores, received)
        if prefill or (policy.interval is not None and steps % policy.interval == 0):
            keep = policy.keep_mask(scores, cache.seqlens, cache.seqlens + evicted)
            if not bool((keep.sum(dim=1) == cache.seqlens).all()):
                order, lengths = cache.keep_order(keep)
                evicted = evicted + cache.seqlens - lengths
                scores = policy.compacted(scores, order, lengths)
                turned = turned_rope_keys(cache, layer.rotary, order, lengths) if policy.reposition else None
                cache.apply_keep(order, lengths)  # rows move: what follows writes what was computed above
                if turned is not None:
                    batch_idx, slot_idx, rows = turned
                    for name, value in rows.items():
                        cache.fields[name].write(batch_idx, slot_idx, value)
                    cache.restart_positions()
            if not policy.keeps_scores:  # SnapKV: the next eviction observes anew
                scores = None
        self.steps, self.scores, self.evicted = steps, scores, evicted


@torch.no_grad()
def turned_rope_keys(cache, rotary, order: torch.Tensor, lengths: torch.Tensor) -> tuple:
    """StreamingLLM's re-positioning, prepared before ``cache.apply_keep`` moves the rows: the
    token that slot i will hold (old slot order[b, i], i < lengths[b]) gets RoPE position i.

    Only the small RoPE key turns, by (i - its position) with ``rotary.shift``: the latent and
    the key scalars carry no position. Rows go through the cache's codec (load, turn, store),
    so a codec gets its own format back (a quantized latent is re-quantized from its
    dequantized values); a token already at its new slot's position is not touched.

    Returns (batch_idx [N], slot_idx [N], {field: rows [N, width]}): what to write after the
    keep, followed by ``cache.restart_positions()``.
    """
    positions = cache.slot_positions().gather(1, order)  # [B, S]: each new slot's token's position
    slots = torch.arange(order.shape[1], device=positions.device)
    batch_idx, slot_idx = ((positions != slots) & (slots < lengths[:, None])).nonzero(as_tuple=True)
    if not len(batch_idx):
        return batch_idx, slot_idx, {}
    src = order[batch_idx, slot_idx]
    rows = {name: buf.gather(batch_idx, src)[None] for name, buf in cache.fields.items()}  # [1, N, width]
    latent, key_scale = cache.codec.load(rows)
    c_kv, k_rope = latent.split([cache.kv_lora_rank, cache.qk_rope_head_dim], dim=-1)
    offsets = (slot_idx - positions[batch_idx, slot_idx])[None]  # [1, N], <= 0
    k_rope = rotary.shift(k_rope[:, :, None], offsets).squeeze(2)
    stored = {name: value[0] for name, value in cache.codec.store(c_kv, k_rope, key_scale).items()}
    return batch_idx, slot_idx, stored
