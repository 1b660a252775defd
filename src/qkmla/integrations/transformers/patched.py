"""Finding the parts of a transformers DeepSeek model that ``apply_latent_attention`` patched.

Kept apart from ``model`` (which patches) so that the cache (``cache``) can build itself
for a patched model without importing the patching code.
"""

from __future__ import annotations

SUPPORTED = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV2Model", "DeepseekV3Model",
             "DeepseekV32ForCausalLM", "DeepseekV32Model")  # V3.2: sparse attention (sparse.py), transformers 5.x


def inner_model(model):
    """The ``*Model`` holding the decoder layers, after checking the model's class."""
    import transformers

    classes = tuple(c for c in (getattr(transformers, name, None) for name in SUPPORTED) if c is not None)
    if not isinstance(model, classes):
        raise ValueError(f"model: expected one of {SUPPORTED} (the DeepSeek-V2/V3/V3.2 architecture), got "
                         f"{type(model).__name__}")
    return model.model if hasattr(model, "lm_head") else model


def model_settings(model):
    """The shared settings of a patched model (``attention.LatentSettings``); ValueError if it
    was not patched."""
    settings = getattr(inner_model(model), "_qkmla_settings", None)
    if settings is None:
        raise ValueError("model: its attention is transformers' own; call "
                         "qkmla.integrations.transformers.apply_latent_attention(model) first")
    return settings


def latent_layers(model) -> list:
    """Every decoder layer's patched attention module (``attention.LatentAttention``), in order."""
    model_settings(model)
    return [layer.self_attn for layer in inner_model(model).layers]
