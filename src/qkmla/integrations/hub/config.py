"""A Hugging Face DeepSeek-V2/V3 config and its attention weights into :class:`~qkmla.MLA`.

:class:`~qkmla.MLA` uses HF's parameter names (``q_a_proj``, ``q_a_layernorm``,
``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``), so an HF attention state dict loads without renaming. Only the QK-norm
weights (``q_norm.*``, ``k_norm.*``) and a learnable ``logit_scale`` are ours; an HF
layer has none, so they keep their initial values (ones: the norm starts as a pure
statistic, which changes the layer's function; see :mod:`qkmla.convert.qk_norm` for what it
computes then and for the warm start).

RoPE is read as transformers reads it: the default, or YaRN (``rope_parameters`` in
transformers 5, ``rope_scaling`` in 4.x and DeepSeek's config.json), which becomes
``MLAConfig.rope_scaling``; any other type is refused.

Nothing here imports ``transformers``: these functions read attributes of the config and
tensors of the state dict, so they also work on a checkpoint opened with safetensors.
"""

from __future__ import annotations

import copy
from typing import Mapping, Optional

import torch

from ...attention.mla import MLA
from ...config import MLAConfig
from ...rope import ROPE_TYPES, YarnScaling

_OURS = ("q_norm.", "k_norm.", "logit_scale")


_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_MISSING = object()


def _get(hf_config, name: str, default=_MISSING):
    """An attribute of an HF config object, or a key of a config.json dict."""
    value = hf_config.get(name, default) if isinstance(hf_config, Mapping) else getattr(hf_config, name, default)
    if value is _MISSING:
        raise ValueError(f"hf_config: a DeepSeek-V2/V3 config needs {name!r}, which is missing")
    return value


def hf_rope(hf_config) -> tuple[float, Optional[YarnScaling]]:
    """(rope_theta, YaRN scaling or None) as transformers reads them.

    transformers 5.x keeps them in ``rope_parameters`` (``rope_theta`` included); 4.x configs
    and DeepSeek's own config.json have ``rope_scaling`` (``type`` for ``rope_type``) and a
    top-level ``rope_theta``. As in HF's standardization, a top-level
    ``original_max_position_embeddings`` wins, and max_position_embeddings stands in for a
    missing one.
    """
    rope = _get(hf_config, "rope_parameters", None) or _get(hf_config, "rope_scaling", None) or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"hf_config: rope_parameters / rope_scaling must be a dict, got {type(rope).__name__}")
    rope = dict(rope)
    theta = rope.get("rope_theta") or _get(hf_config, "rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"hf_config: rope_type {rope_type!r} is not supported; allowed: {ROPE_TYPES}")
    if rope_type == "default":
        return float(theta), None
    top = _get(hf_config, "original_max_position_embeddings", None)
    if top is not None:
        rope["original_max_position_embeddings"] = top
    elif rope.get("original_max_position_embeddings") is None:
        rope["original_max_position_embeddings"] = _get(hf_config, "max_position_embeddings")
    return float(theta), YarnScaling.from_dict(rope, "hf_config.rope_scaling")


def mla_config_from_hf(hf_config, **overrides) -> MLAConfig:
    """An :class:`MLAConfig` from an HF ``DeepseekV2Config`` / ``DeepseekV3Config``, or a config.json dict.

    Args:
        hf_config: the HF config (any object with its attributes), or the parsed config.json.
        overrides: MLAConfig fields to set, e.g. ``qk_norm="rms"``; by default ``qk_norm=None``,
            which reproduces the HF layer.

    Raises:
        ValueError: a model_type other than deepseek_v2 / deepseek_v3, a RoPE type other than
            "default" or "yarn", bad YaRN parameters, or a missing field.
    """
    model_type = _get(hf_config, "model_type", None)
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"hf_config: model_type must be one of {_MODEL_TYPES}, got {model_type!r}")
    theta, scaling = hf_rope(hf_config)
    # V2 always rotates interleaved pairs; V3 does unless rope_interleave is False.
    interleave = True if model_type == "deepseek_v2" else bool(_get(hf_config, "rope_interleave", True))
    heads = _get(hf_config, "num_attention_heads")
    fields = dict(
        hidden_size=_get(hf_config, "hidden_size"), num_heads=heads, num_kv_groups=heads,
        q_lora_rank=_get(hf_config, "q_lora_rank", None), kv_lora_rank=_get(hf_config, "kv_lora_rank"),
        qk_nope_head_dim=_get(hf_config, "qk_nope_head_dim"), qk_rope_head_dim=_get(hf_config, "qk_rope_head_dim"),
        v_head_dim=_get(hf_config, "v_head_dim"), rope_theta=theta, rope_interleave=interleave,
        rope_scaling=scaling, attention_bias=bool(_get(hf_config, "attention_bias", False)),
        latent_norm_eps=1e-6,  # HF builds q_a_layernorm / kv_a_layernorm with their default eps
        qk_norm=None,
    )
    fields.update(overrides)
    return MLAConfig(**fields)


def load_hf_attention_weights(mla: MLA, state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> MLA:
    """Copy an HF attention layer's weights into ``mla``.

    Args:
        state_dict: an HF attention state dict, or a whole-model one with ``prefix`` such as
            ``"model.layers.3.self_attn."`` (other keys are ignored).

    Raises:
        ValueError: a weight is missing or has the wrong shape.
    """
    own = mla.state_dict()
    wanted = [k for k in own if not k.startswith(_OURS)]
    missing = [prefix + k for k in wanted if prefix + k not in state_dict]
    if missing:
        raise ValueError(f"state_dict: missing {missing} (prefix={prefix!r})")
    for k in wanted:
        src = state_dict[prefix + k]
        if tuple(src.shape) != tuple(own[k].shape):
            raise ValueError(f"state_dict: {prefix + k} has shape {tuple(src.shape)}, this MLA needs {tuple(own[k].shape)}")
    with torch.no_grad():
        for name, p in list(mla.named_parameters()) + list(mla.named_buffers()):
            if name in wanted:
                p.copy_(state_dict[prefix + name])
    return mla


HF_PROJECTIONS = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                  "kv_b_proj", "o_proj")


def hf_projections(hf_attention) -> dict:
    """The projection and latent-norm modules an HF DeepSeek attention layer has, by name."""
    found = {name: getattr(hf_attention, name, None) for name in HF_PROJECTIONS}
    return {name: module for name, module in found.items() if module is not None}


def mla_from_hf(hf_attention, **overrides) -> MLA:
    """A standalone :class:`MLA` with copies of an HF ``DeepseekV2Attention`` / ``DeepseekV3Attention``'s
    projections: the per-layer step of ``apply_latent_attention`` (which adopts the modules
    instead of copying them), with MLA's own call signature.

    Examples:
        >>> mla = mla_from_hf(hf_model.model.layers[0].self_attn)             # doctest: +SKIP
        >>> mla_qk = mla_from_hf(hf_layer, qk_norm="rms")  # start QK-norm training from HF weights  # doctest: +SKIP
    """
    config = mla_config_from_hf(hf_attention.config, **overrides)
    weight = next(hf_attention.parameters())
    mla = MLA(config, copy.deepcopy(hf_projections(hf_attention)))
    return mla.to(device=weight.device, dtype=weight.dtype)
