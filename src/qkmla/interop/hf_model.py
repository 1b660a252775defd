"""A whole transformers DeepSeek-V2/V3 model decoding through qkmla's latent cache.

    model = DeepseekV3ForCausalLM.from_pretrained(path)
    apply_latent_attention(model)                      # in place; returns the model
    out = model.generate(input_ids, attention_mask=mask, max_new_tokens=64)

:func:`apply_latent_attention` swaps every decoder layer's ``self_attn`` for a
:class:`~qkmla.interop.hf_attention.LatentAttention` that adopts the layer's own projection
modules (no copy: ``state_dict()`` keys and tensors stay transformers' own) and registers two
hooks on the inner ``*Model``:

* before its forward: the caller's 2-D ``attention_mask`` and ``position_ids`` go into the
  layers' shared :class:`~qkmla.interop.hf_attention.ForwardContext`; a forward that caches
  gets a :class:`~qkmla.interop.hf_cache.LatentAttentionCache` (or its empty ``DynamicCache``
  becomes one); a training forward with no cache passed caches nothing;
* after it: the context is cleared, so nothing of one call reaches the next.

Embeddings, MLP and MoE, the final norm, the LM head and the generation utilities stay
transformers' own. transformers' attention-function registry is not used: it only ever
receives expanded keys and values, which the absorbed path never forms.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from ..cache.eviction import EvictionPolicy
from ..ops.mla_decode.interface import DECODE_BACKENDS
from .hf_attention import ForwardContext, LatentAttention
from .hf_cache import LatentAttentionCache, adopt_layer, check_cache_settings

SUPPORTED = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "DeepseekV2Model", "DeepseekV3Model")


def _inner(model):
    """The ``*Model`` holding the decoder layers, after checking the model's class."""
    import transformers

    classes = tuple(getattr(transformers, name) for name in SUPPORTED)
    if not isinstance(model, classes):
        raise ValueError(f"model: expected one of {SUPPORTED} (DeepSeek-V2/V3 architecture: DeepSeek-V2, V2-Lite, V3, "
                         f"Kimi K2, Moonlight), got {type(model).__name__}")
    return model.model if hasattr(model, "lm_head") else model


def model_context(model) -> ForwardContext:
    """The shared context of a patched model; ValueError if it was not patched."""
    context = getattr(_inner(model), "_qkmla_context", None)
    if context is None:
        raise ValueError("model: its attention is transformers' own; call qkmla.interop.apply_latent_attention(model) "
                         "first")
    return context


def latent_layers(model) -> list[LatentAttention]:
    """Every decoder layer's patched attention module, in order."""
    model_context(model)
    return [layer.self_attn for layer in _inner(model).layers]


def apply_latent_attention(model, *, kv_format: str = "dense", policy: Optional[EvictionPolicy] = None,
                           decode_backend: str = "auto"):
    """Make a transformers DeepSeek-V2/V3 model attend and decode through qkmla, in place.

    Args:
        model: a ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` or the inner ``*Model``.
        kv_format: how the caches the model makes for itself store the latent
            (``qkmla.kv_formats.KV_FORMATS``: "dense", "fp8", "int8", "int4").
        policy: an eviction policy those caches run (``qkmla.cache.StreamingLLM``, ``H2O``,
            ``SnapKV``), or None to keep every token.
        decode_backend: the decode op's backend ("auto", "torch", "triton", "naive").

    Calling it again on a patched model changes these settings and nothing else.

    Returns:
        ``model``.
    """
    inner = _inner(model)
    check_cache_settings(kv_format, policy, None)
    if decode_backend not in DECODE_BACKENDS:
        raise ValueError(f"decode_backend: expected one of {DECODE_BACKENDS}, got {decode_backend!r}")
    context = getattr(inner, "_qkmla_context", None)
    if context is not None:  # already patched: new settings only
        context.kv_format, context.policy = kv_format, policy
        for layer in inner.layers:
            layer.self_attn.config = layer.self_attn.config.replace(decode_backend=decode_backend)
        return model
    context = ForwardContext(kv_format=kv_format, policy=policy)
    patched = [LatentAttention.from_hf(layer.self_attn, context, decode_backend=decode_backend) for layer in inner.layers]
    for layer, attn in zip(inner.layers, patched):
        layer.self_attn = attn
    inner._qkmla_context = context
    inner.register_forward_pre_hook(_before_forward, with_kwargs=True)
    inner.register_forward_hook(_after_forward, always_call=True)
    return model


def _call_arguments(module, args, kwargs) -> dict:
    """The forward call's arguments by name (positional ones included)."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
    except TypeError:
        return dict(kwargs) if not args else None
    arguments = dict(bound.arguments)
    for name, param in inspect.signature(module.forward).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


def _before_forward(module, args, kwargs):
    arguments = _call_arguments(module, args, kwargs)
    if arguments is None:
        raise ValueError("model: pass its inputs by name (input_ids=..., attention_mask=...)")
    context: ForwardContext = module._qkmla_context
    mask, position_ids = arguments.get("attention_mask"), arguments.get("position_ids")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        got = f"{mask.dim()}-D tensor" if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask: qkmla's latent attention reads the 2-D padding mask [batch, length] "
                         f"(1 = token, 0 = padding), got a {got}")
    if arguments.get("output_attentions"):
        raise ValueError("output_attentions: qkmla's latent attention never forms transformers' attention "
                         "weights (the absorbed path attends in latent space); call without it")
    names = [n for n in ("cache", "past_key_values") if arguments.get(n) is not None]
    cache = arguments.get(names[0]) if names else None
    name = names[0] if names else ("cache" if "cache" in inspect.signature(module.forward).parameters
                                   else "past_key_values")
    use_cache = arguments.get("use_cache")
    use_cache = module.config.use_cache if use_cache is None else use_cache
    if cache is None and use_cache:
        if module.training:  # a training step caches nothing (transformers would make a DynamicCache)
            arguments["use_cache"] = False
        else:
            arguments[name] = LatentAttentionCache(module)
    elif cache is not None:
        for layer in module.layers:  # an empty transformers cache becomes a latent one, before any work
            adopt_layer(cache, layer.self_attn.layer_idx, layer.self_attn.config, context.kv_format, context.policy)
    context.attention_mask, context.position_ids = mask, position_ids
    return (), arguments


def _after_forward(module, args, output):
    context: ForwardContext = module._qkmla_context
    context.attention_mask = context.position_ids = None
    return output
