"""transformers: a whole MLA model decoding through qkmla's latent cache (``pip install "qkmla[hf]"``).

    model = apply_latent_attention(AutoModelForCausalLM.from_pretrained(path))   # in place
    model = from_pretrained(qk_normed_dir)                                        # a QK-normed checkpoint

``LatentAttentionCache`` is the cache ``generate`` uses (made for you; pass one to set its format or
eviction policy); ``attention_lora_config`` / ``merge_lora`` fine-tune the attention with PEFT.
Imported on first use, so ``import qkmla.integrations.transformers`` works without transformers.
"""

_DOORS = {"apply_latent_attention": "model", "from_pretrained": "load", "LatentAttentionCache": "cache",
          "attention_lora_config": "lora", "merge_lora": "lora"}


def __getattr__(name: str):
    if name in _DOORS:
        import importlib

        try:
            module = importlib.import_module(f".{_DOORS[name]}", __name__)
        except ImportError as e:
            raise ImportError(f"qkmla.integrations.transformers.{name} needs transformers>=5.4: "
                              f"pip install 'qkmla[hf]' ({e})") from e
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_DOORS)
