"""Hugging Face checkpoint directories read without transformers.

``mla_layers_from_hf_dir(dir, layers)`` builds qkmla :class:`~qkmla.MLA` layers from a DeepSeek-V2/V3
checkpoint directory; ``mla_from_hf(hf_attention)`` from an attention module already loaded. A
checkpoint qkmla saved records its QK norm in config.json (``record``): its layers are built with
that norm and its weights, never as plain MLA.
"""

from .checkpoint import mla_layers_from_hf_dir
from .config import mla_from_hf

__all__ = ["mla_from_hf", "mla_layers_from_hf_dir"]
