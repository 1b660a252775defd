"""Hugging Face checkpoint directories read without transformers.

``mla_layers_from_hf_dir(dir, layers)`` builds qkmla :class:`~qkmla.MLA` layers from a DeepSeek-V2/V3
checkpoint directory; ``mla_from_hf(hf_attention)`` from an attention module already loaded.
"""

from .checkpoint import mla_layers_from_hf_dir
from .config import mla_from_hf

__all__ = ["mla_from_hf", "mla_layers_from_hf_dir"]
