"""Decode caches: the latent cache (+ scalars, dense or quantized), the naive full-key cache, and their sizes."""

from ..kv_formats import KV_FORMATS
from .base import SequenceCache, WriteSlot
from .full import FullKVCache
from .latent import LatentCache
from .storage import ContiguousLayout, PagedLayout

__all__ = ["KV_FORMATS", "ContiguousLayout", "FullKVCache", "LatentCache", "PagedLayout", "SequenceCache", "WriteSlot"]
