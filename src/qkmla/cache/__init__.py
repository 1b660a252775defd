"""Decode caches: the latent cache (+ scalars), the naive full-key cache, and their sizes."""

from .base import SequenceCache, WriteSlot
from .full import FullKVCache
from .latent import LatentCache
from .storage import ContiguousLayout, PagedLayout

__all__ = ["ContiguousLayout", "FullKVCache", "LatentCache", "PagedLayout", "SequenceCache", "WriteSlot"]
