"""A latent cache layer that also keeps a sparse attention indexer's keys.

DeepSeek-V3.2's lightning indexer (transformers' ``DeepseekV32Indexer``) keeps a small key cache of
its own, [B, columns, index_head_dim], which it reaches through ``cache.update_indexer(keys,
layer_idx)``: transformers' ``DynamicIndexedLayer`` holds it beside the keys and values.
:class:`SparseLatentCacheLayer` holds it beside qkmla's latent rows instead, so the indexer runs
unchanged over a latent cache.

The indexer's keys are kept per *column*, padding included, as transformers keeps them (its
selection is a column of its mask); the latent cache keeps only real tokens. ``stored`` [B,
columns] (the base layer's record of which columns were real) maps one to the other:
:func:`column_slots`. Every operation transformers' generation utilities call on a cache layer
(``crop``, ``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``, ``reset``,
``offload`` / ``prefetch``) applies to both, so beam search, assisted decoding and a continued
``generate`` keep them in step.
"""

from __future__ import annotations

from typing import Optional

import torch

from .cache import LatentCacheLayer, adopt_layer


class SparseLatentCacheLayer(LatentCacheLayer):
    """:class:`~.cache.LatentCacheLayer` plus the indexer's key cache ``indexer_keys`` [B, columns,
    index_head_dim] (None before the indexer's first call). Same arguments as the base layer; an
    eviction policy is refused (an evicted row would leave its column selectable)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.policy is not None:
            raise ValueError("policy: a sparse attention model's indexer selects among every cached column, so its "
                             "latent cache cannot evict tokens; patch it with policy=None")
        self.indexer_keys: Optional[torch.Tensor] = None

    def __repr__(self) -> str:
        keys = None if self.indexer_keys is None else tuple(self.indexer_keys.shape)
        return f"Sparse{super().__repr__()[:-1]}, indexer_keys={keys})"

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Append the indexer's keys for the call's columns [B, T, index_head_dim]; return them all
        [B, columns + T, index_head_dim] (transformers' ``DynamicIndexedLayer.update_indexer``)."""
        if self.indexer_keys is None:
            self.indexer_keys = indexer_key_states
        else:
            if self.indexer_keys.device != indexer_key_states.device:  # offloaded between forwards
                self.indexer_keys = self.indexer_keys.to(indexer_key_states.device)
            self.indexer_keys = torch.cat((self.indexer_keys, indexer_key_states), dim=1)
        return self.indexer_keys

    def drop_indexer_columns(self, columns: int) -> None:
        """Keep the indexer's first ``columns`` columns (undoes a forward that failed after the indexer wrote)."""
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[:, :columns] if columns > 0 else None

    def reset(self) -> None:
        super().reset()
        self.indexer_keys = None

    def crop(self, tokens: int) -> None:
        before = self.columns
        super().crop(tokens)
        if self.columns < before:
            self.drop_indexer_columns(self.columns)

    def _select(self, indices: torch.Tensor) -> None:
        super()._select(indices)
        if self.indexer_keys is not None:
            self.indexer_keys = self.indexer_keys[indices.to(self.indexer_keys.device)]

    def _move_rows(self, device: torch.device) -> None:
        super()._move_rows(device)
        if self.indexer_keys is not None and self.indexer_keys.device != device:
            self.indexer_keys = self.indexer_keys.to(device, non_blocking=True)


def sparse_cache_layer(cache, layer_idx: int, config, kv_format: str = "dense", policy=None) -> SparseLatentCacheLayer:
    """``cache``'s layer ``layer_idx`` as a :class:`SparseLatentCacheLayer`: what :func:`~.cache.adopt_layer`
    makes of the slot (an empty transformers layer becomes a latent one), given the indexer's key
    cache while still empty. A static latent layer, or one already holding rows without the indexer's
    keys, is refused."""
    layer = adopt_layer(cache, layer_idx, config, kv_format, policy)
    if isinstance(layer, SparseLatentCacheLayer):
        return layer
    if not isinstance(layer, LatentCacheLayer):
        raise ValueError("cache_implementation: a sparse attention model (its indexer's top-k selection) decodes "
                         "over the growing latent cache; the static latent cache (cache_implementation=\"static\") "
                         "does not keep the indexer's keys. Use the default cache")
    if layer.latent is not None:
        raise ValueError(f"cache: layer {layer_idx} already holds latent rows without the indexer's keys (filled by a "
                         f"model without sparse attention); start from an empty cache")
    sparse = SparseLatentCacheLayer(layer.config, layer.kv_format, layer.policy, layer.max_cache_len,
                                    layer.offloading)
    cache.layers[layer_idx] = sparse
    return sparse


def column_slots(columns: torch.Tensor, visible: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The indexer's choice as latent cache slots: the decode op's ``indices``.

    Args:
        columns: [B, C] bool, which of the C columns (cached and new) are real tokens; the latent
            cache holds the real ones, in order, at slots 0, 1, 2, ...
        visible: [B, T, C] bool, the mask the indexer was given (causal, padding out).
        chosen: [B, T, topk] int, the columns the indexer chose per new token (its top-k may
            include masked columns when fewer than topk are visible).

    Returns:
        [B, T, topk] int64: each chosen visible column's slot, -1 for a masked one.
    """
    B, T, k = chosen.shape
    chosen = chosen.long()
    slot_of = columns.long().cumsum(dim=1) - 1  # [B, C]
    slots = slot_of.gather(1, chosen.reshape(B, T * k)).view(B, T, k)
    return torch.where(visible.gather(-1, chosen), slots, -1)
