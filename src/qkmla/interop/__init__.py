"""Interop with other libraries' weights (Hugging Face transformers checkpoints)."""

from .checkpoint import mla_from_hf_dir, mla_layers_from_hf_dir, read_hf_config
from .hf import load_hf_attention_weights, mla_config_from_hf, mla_from_hf

__all__ = ["load_hf_attention_weights", "mla_config_from_hf", "mla_from_hf", "mla_from_hf_dir",
           "mla_layers_from_hf_dir", "read_hf_config"]
