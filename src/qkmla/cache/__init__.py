"""Decode caches: the latent cache (+ scalars, dense or quantized), the naive full-key cache, and
their sizes; eviction policies that drop cached tokens."""

from ..kv_formats import KV_FORMATS
from .base import SequenceCache, WriteSlot
from .eviction import H2O, POLICIES, EvictionPolicy, SnapKV, StreamingLLM, make_policy
from .full import FullKVCache
from .latent import LatentCache
from .storage import ContiguousLayout, PagedLayout

__all__ = ["KV_FORMATS", "ContiguousLayout", "EvictionPolicy", "FullKVCache", "H2O", "LatentCache", "POLICIES",
           "PagedLayout", "SequenceCache", "SnapKV", "StreamingLLM", "WriteSlot", "make_policy"]
