"""Hugging Face checkpoint directories read without transformers.

``mla_layers_from_hf_dir(dir, layers)`` builds qkmla :class:`~qkmla.MLA` layers from a DeepSeek-V2/V3
checkpoint directory; ``mla_from_hf(hf_attention)`` from an attention module already loaded. A
checkpoint qkmla saved records its QK norm in config.json (``record``): its layers are built with
that norm and its weights, never as plain MLA; a QK-normed checkpoint also declares a model type of its
own (``qkmla_deepseek_v3``), which these read as DeepSeek's. ``checkpoint_dir(name, revision=...,
cache_dir=...)`` is a hub repository's snapshot in the local hub cache (fetched, or offline from the cache).
"""

from .checkpoint import checkpoint_dir, mla_layers_from_hf_dir
from .config import mla_from_hf

__all__ = ["checkpoint_dir", "mla_from_hf", "mla_layers_from_hf_dir"]
