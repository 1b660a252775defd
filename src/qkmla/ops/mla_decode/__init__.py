"""MLA decode over a paged latent cache: Triton kernel, custom op, and its float32 reference."""

from .interface import BACKENDS, mla_decode_with_kvcache
from .naive import naive_mla_decode

__all__ = ["BACKENDS", "mla_decode_with_kvcache", "naive_mla_decode"]
