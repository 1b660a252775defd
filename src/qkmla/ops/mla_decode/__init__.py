"""The MLA decode op over a latent cache: one interface, backends naive (the spec), torch, cpu and triton."""

from .backends import DECODE_BACKENDS, check_backend, resolve_backend, select_backend
from .interface import mla_decode_with_kvcache
from .naive import naive_mla_decode

__all__ = ["DECODE_BACKENDS", "check_backend", "mla_decode_with_kvcache", "naive_mla_decode", "resolve_backend",
           "select_backend"]
