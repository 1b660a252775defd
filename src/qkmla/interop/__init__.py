"""Interop with other libraries' weights and models (Hugging Face transformers).

The transformers integration (``apply_latent_attention``, ``LatentAttentionCache``) is imported
on first use, so ``import qkmla.interop`` works without transformers installed.
"""

from .checkpoint import mla_from_hf_dir, mla_layers_from_hf_dir, read_hf_config, read_hf_tensors
from .calibrate import warm_start_qk_norm
from .convert import convert_checkpoint
from .hf import load_hf_attention_weights, mla_config_from_hf, mla_from_hf

_LAZY = {"apply_latent_attention": "hf_model", "latent_layers": "hf_patched", "LatentAttentionCache": "hf_cache",
         "LatentCacheLayer": "hf_cache", "LatentAttention": "hf_attention", "from_pretrained": "hf_load",
         "attention_lora_config": "hf_lora", "merge_lora": "hf_lora", "convert_gqa": "gqa"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        try:
            module = importlib.import_module(f".{_LAZY[name]}", __name__)
        except ImportError as e:
            raise ImportError(f"qkmla.interop.{name} needs transformers>=5.4: pip install 'qkmla[hf]' ({e})") from e
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LatentAttention", "LatentAttentionCache", "LatentCacheLayer", "apply_latent_attention",
           "attention_lora_config", "convert_checkpoint", "convert_gqa", "from_pretrained", "latent_layers",
           "load_hf_attention_weights", "merge_lora", "mla_config_from_hf", "mla_from_hf", "mla_from_hf_dir",
           "mla_layers_from_hf_dir", "read_hf_config", "read_hf_tensors", "warm_start_qk_norm"]
