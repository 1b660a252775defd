"""transformers: a whole MLA model decoding through qkmla's latent cache (``pip install "qkmla[hf]"``).

    model = apply_latent_attention(AutoModelForCausalLM.from_pretrained(path))   # in place
    model = from_pretrained(qk_normed_dir)                                        # a QK-normed checkpoint

``LatentAttentionCache`` is the cache ``generate`` uses (made for you; pass one to set its format or
eviction policy); ``attention_lora_config`` / ``merge_lora`` fine-tune the attention with PEFT.
Each is imported on first use, so ``import qkmla.integrations.transformers`` works without
transformers. With transformers installed, importing this package registers a QK-normed checkpoint's own
architecture (``QKNormDeepseekV3ForCausalLM``, model type ``qkmla_deepseek_v3``; and V2) with
transformers' ``AutoConfig`` and ``AutoModelForCausalLM`` (``auto``), so they and ``pipeline`` load
such a checkpoint with its norm; and the same for every other supported MLA family with classes of
its own (``QKNormGlm4MoeLiteForCausalLM``, model type ``qkmla_glm4_moe_lite``, ...). Which families
``apply_latent_attention`` takes, and why it refuses the others, is one table: ``families``.
"""

import importlib.util

if importlib.util.find_spec("transformers") is not None:
    try:
        from . import auto  # noqa: F401  (registers qkmla's architectures with transformers' Auto classes)
    except ImportError:  # a transformers qkmla does not support: the doors below say so when used
        pass

_DOORS = {"apply_latent_attention": "model", "from_pretrained": "load", "LatentAttentionCache": "cache",
          "attention_lora_config": "lora", "merge_lora": "lora",
          "QKNormDeepseekV2ForCausalLM": "auto", "QKNormDeepseekV3ForCausalLM": "auto"}


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
