"""Hugging Face interop: DeepSeek-V2/V3 attention weights into :class:`~qkmla.MLA`.

:class:`~qkmla.MLA` uses HF's parameter names (``q_a_proj``, ``q_a_layernorm``,
``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``), so an HF attention state dict loads without renaming. Only the QK-norm
weights (``q_norm.*``, ``k_norm.*``) and a learnable ``logit_scale`` are ours; an HF
layer has none, so they keep their initial values (ones: the norm starts as a pure
statistic).

Nothing here imports ``transformers``: these functions read attributes of the config and
tensors of the state dict, so they also work on a checkpoint opened with safetensors.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..attention.mla import MLA
from ..config import MLAConfig

_OURS = ("q_norm.", "k_norm.", "logit_scale")


def mla_config_from_hf(hf_config, **overrides) -> MLAConfig:
    """An :class:`MLAConfig` from an HF ``DeepseekV2Config`` or ``DeepseekV3Config``.

    Args:
        hf_config: the HF config (any object with its attributes).
        overrides: MLAConfig fields to set, e.g. ``qk_norm="rms"``; by default ``qk_norm=None``,
            which reproduces the HF layer.

    Raises:
        ValueError: for a RoPE scaling type other than the default (YaRN is not supported yet).
    """
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"hf_config: rope_type {rope_type!r} is not supported; allowed: 'default'")
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    model_type = getattr(hf_config, "model_type", "deepseek_v3")
    if model_type not in ("deepseek_v2", "deepseek_v3"):
        raise ValueError(f"hf_config: model_type must be 'deepseek_v2' or 'deepseek_v3', got {model_type!r}")
    # V2 always rotates interleaved pairs; V3 does unless rope_interleave is False.
    interleave = True if model_type == "deepseek_v2" else bool(getattr(hf_config, "rope_interleave", True))
    fields = dict(
        hidden_size=hf_config.hidden_size, num_heads=hf_config.num_attention_heads,
        num_kv_groups=hf_config.num_attention_heads, q_lora_rank=hf_config.q_lora_rank,
        kv_lora_rank=hf_config.kv_lora_rank, qk_nope_head_dim=hf_config.qk_nope_head_dim,
        qk_rope_head_dim=hf_config.qk_rope_head_dim, v_head_dim=hf_config.v_head_dim, rope_theta=float(theta),
        rope_interleave=interleave, attention_bias=bool(getattr(hf_config, "attention_bias", False)),
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


def mla_from_hf(hf_attention, **overrides) -> MLA:
    """A new :class:`MLA` holding the weights of an HF ``DeepseekV2Attention`` / ``DeepseekV3Attention``.

    Examples:
        >>> mla = mla_from_hf(hf_model.model.layers[0].self_attn)             # doctest: +SKIP
        >>> mla_qk = mla_from_hf(hf_layer, qk_norm="rms")  # start QK-norm training from HF weights  # doctest: +SKIP
    """
    config = mla_config_from_hf(hf_attention.config, **overrides)
    weight = next(hf_attention.parameters())
    mla = MLA(config).to(device=weight.device, dtype=weight.dtype)
    return load_hf_attention_weights(mla, hf_attention.state_dict())
