"""The MLA decode op over a latent cache: one interface, backends naive (the spec), torch and triton."""

from .interface import DECODE_BACKENDS, mla_decode_with_kvcache, select_backend
from .naive import naive_mla_decode

__all__ = ["DECODE_BACKENDS", "mla_decode_with_kvcache", "naive_mla_decode", "select_backend"]
