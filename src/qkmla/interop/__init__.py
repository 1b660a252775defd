"""Interop with other libraries' weights (Hugging Face transformers)."""

from .hf import load_hf_attention_weights, mla_config_from_hf, mla_from_hf

__all__ = ["load_hf_attention_weights", "mla_config_from_hf", "mla_from_hf"]
