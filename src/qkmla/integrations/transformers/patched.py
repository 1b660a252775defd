"""Finding the parts of a transformers MLA model that ``apply_latent_attention`` patched.

Kept apart from ``model`` (which patches) so that the cache (``cache``) can build itself
for a patched model without importing the patching code. Which models are taken, and how, is
the table of families (``families``).
"""

from __future__ import annotations

from .families import FAMILIES, attention_slots, family_named, get_slot, is_mla_attention, refusal

SUPPORTED = tuple(name for f in FAMILIES if f.status == "supported" for name in f.classes)


def model_family(model):
    """The :class:`~.families.Family` row of ``model``, after checking its class: a supported
    family's whole model or inner model; anything else refused naming the class and the reason."""
    import transformers

    name = type(model).__name__
    family = family_named(getattr(getattr(model, "config", None), "model_type", None))
    if family is None:
        found = next((type(m).__name__ for m in model.modules() if is_mla_attention(m)), None) \
            if hasattr(model, "modules") else None
        what = (f"it has MLA attention ({found}), but its family {getattr(model.config, 'model_type', None)!r} is "
                f"not in qkmla's table of families (families.FAMILIES), so its conventions (RoPE layout, scales) "
                f"are unknown" if found else "it has no MLA attention (kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj)")
        raise ValueError(f"model: expected one of {SUPPORTED}, got {name}: {what}")
    if family.status != "supported":
        raise ValueError(refusal(family, name))
    classes = tuple(c for c in (getattr(transformers, n, None) for n in family.classes) if c is not None)
    # a subclass (qkmla's QK-normed architecture, a test's) by the first transformers class it extends
    if not isinstance(model, classes):
        raise ValueError(f"model: expected one of {family.classes} (the {family.model_type} architecture), "
                         f"got {name}")
    return family


def inner_model(model):
    """The ``*Model`` holding the decoder layers, after checking the model's class."""
    model_family(model)
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
    """Every patched attention module (``attention.LatentAttention``), in cache order (a hybrid's
    linear-attention layers are not among them)."""
    model_settings(model)
    return [get_slot(slot) for slot in attention_slots(inner_model(model))]


def cache_slots(model) -> list:
    """For each of the model's cache layers (transformers' ``layer_idx``): its patched attention
    module, or None where the layer is transformers' own (a hybrid's linear attention)."""
    layers = latent_layers(model)
    inner = inner_model(model)
    count = max([attn.layer_idx + 1 for attn in layers] + [len(inner.layers)])
    by_index = {attn.layer_idx: attn for attn in layers}
    return [by_index.get(i) for i in range(count)]
