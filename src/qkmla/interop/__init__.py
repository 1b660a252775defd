"""Interop with other libraries' weights (Hugging Face transformers checkpoints)."""

from .checkpoint import mla_from_hf_dir, mla_layers_from_hf_dir, read_hf_config, read_hf_tensors
from .convert import convert_hf_dir, load_converted, save_converted, warm_start_qk_norm
from .hf import load_hf_attention_weights, mla_config_from_hf, mla_from_hf

__all__ = ["convert_hf_dir", "load_converted", "load_hf_attention_weights", "mla_config_from_hf", "mla_from_hf",
           "mla_from_hf_dir", "mla_layers_from_hf_dir", "read_hf_config", "read_hf_tensors", "save_converted",
           "warm_start_qk_norm"]
