"""A Hugging Face DeepSeek-V2/V3 config and its attention weights into :class:`~qkmla.MLA`.

:class:`~qkmla.MLA` uses HF's parameter names (``q_a_proj``, ``q_a_layernorm``,
``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``), so an HF attention state dict loads without renaming. Only the QK-norm
weights (``q_norm.*``, ``k_norm.*``) and a learnable ``logit_scale`` are ours; an HF
layer has none, so a norm added to it (``qk_norm="rms"``) starts at its initial values (ones:
the norm starts as a pure statistic, which changes the layer's function; see
:mod:`qkmla.convert.qk_norm` for what it computes then and for the warm start).

A config qkmla saved records its QK norm and KV groups in a ``"qkmla"`` entry
(:mod:`qkmla.integrations.hub.record`); :func:`mla_config_from_hf` reads it, so a QK-normed
checkpoint never loads as plain MLA, and an override that contradicts it is refused.

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
from ...config import MLAConfig, QKNormConfig
from ...rope import ROPE_TYPES, YarnScaling
from ...utils.checked import is_finite_number
from .record import RECORD, describe, recorded_groups, recorded_norm, stock_model_type

_OURS = ("q_norm.", "k_norm.", "logit_scale")


# transformers' DeepSeek model types, and a QK-normed checkpoint's own (hub.record.QK_MODEL_TYPES)
_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "qkmla_deepseek_v2", "qkmla_deepseek_v3")
_MISSING = object()
_HF_NAMES = {"num_heads": "num_attention_heads"}  # MLAConfig's field: the HF config's, where they differ


def _get(hf_config, name: str, default=_MISSING):
    """An attribute of an HF config object, or a key of a config.json dict."""
    value = hf_config.get(name, default) if isinstance(hf_config, Mapping) else getattr(hf_config, name, default)
    if value is _MISSING:
        raise ValueError(f"hf_config: a DeepSeek-V2/V3 config needs {name!r}, which is missing")
    return value


def hf_rope_type(hf_config) -> str:
    """The config's ``rope_type`` ("default" when it has no RoPE parameters), as :func:`hf_rope` reads it."""
    rope = _get(hf_config, "rope_parameters", None) or _get(hf_config, "rope_scaling", None) or {}
    return rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else "default"


def rope_theta(hf_config) -> float:
    """The config's RoPE base, as transformers reads it (``rope_parameters``' first, then the top-level
    field, 10000 where neither is set). ValueError naming rope_theta unless it is a finite number > 0: 0
    was read as the default 10000 (``or``), so qkmla rotated with another base than the config's; True
    passed as 1.0; "abc" failed in float() without a name."""
    rope = _get(hf_config, "rope_parameters", None) or _get(hf_config, "rope_scaling", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
    if theta is None:
        theta = _get(hf_config, "rope_theta", None)
    theta = 10000.0 if theta is None else theta
    if not is_finite_number(theta) or not theta > 0:
        raise ValueError(f"rope_theta: expected a finite number > 0 (RoPE's base), got {theta!r}")
    return float(theta)


def hf_rope(hf_config, any_rope_type: bool = False) -> tuple[float, Optional[YarnScaling]]:
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
    # Mistral 4's position-dependent query scale, which its attention applies beside YaRN
    # (transformers.families.HostAttention.position_temperature), as transformers' DeepSeek ignores it
    rope = {k: v for k, v in rope.items() if k not in ("llama_4_scaling_beta", "max_position_embeddings")}
    # Mistral 4 states its RoPE width as a fraction of head_dim (d_n + d_r): the same d_r rotated
    partial, head_dim = rope.get("partial_rotary_factor"), _get(hf_config, "head_dim", None)
    rope_dim = _get(hf_config, "qk_rope_head_dim", 0)
    if partial not in (None, 1.0) and head_dim and abs(partial * head_dim - rope_dim) < 1e-6:
        rope.pop("partial_rotary_factor")
    theta = rope_theta(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES and any_rope_type:  # the caller rotates with transformers' own embedding
        return float(theta), None
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
        overrides: MLAConfig fields to set, e.g. ``qk_norm="rms"`` to add a norm to a plain
            config. By default ``qk_norm`` and ``num_kv_groups`` are what the config's ``"qkmla"``
            entry records (:mod:`qkmla.integrations.hub.record`), and without one, no norm and a
            KV group per head: the HF layer. ``any_rope_type=True``: a ``rope_type`` other than
            "default" / "yarn" gives plain-RoPE fields instead of an error, for a caller that
            rotates with transformers' own embedding (``transformers.attention.LatentAttention.from_hf``).
            ``any_model_type=True``: any model type, for a caller that already recognised the
            family and overrides what it reads differently (``rope_interleave``; the
            transformers adapter's table of families).

    Raises:
        ValueError: a model_type other than deepseek_v2 / deepseek_v3 (or qkmla's QK-normed
            qkmla_deepseek_v2 / qkmla_deepseek_v3, which must record a norm), a RoPE type other than
            "default" or "yarn", bad YaRN parameters, a missing field, a ``"qkmla"`` entry that is
            not valid, or a ``qk_norm`` / ``num_kv_groups`` override that contradicts it (the
            recorded norm's weights are trained for that norm).
    """

    model_type = _get(hf_config, "model_type", None)
    if model_type not in _MODEL_TYPES and not overrides.pop("any_model_type", False):
        raise ValueError(f"hf_config: model_type must be one of {_MODEL_TYPES}, got {model_type!r}")
    if "qk_norm" in overrides:  # a dict's field refused under qk_norm (it was taken for the config file's)
        overrides["qk_norm"] = QKNormConfig.of(overrides["qk_norm"])
    norm, groups = recorded_norm(hf_config, "hf_config"), recorded_groups(hf_config, "hf_config")
    if norm is not None and "qk_norm" in overrides and QKNormConfig.of(overrides["qk_norm"]) != norm:
        raise ValueError(f"qk_norm: hf_config records the QK norm {describe(norm)} in its {RECORD!r} entry (a "
                         f"checkpoint qkmla saved, its weights trained for that norm), but "
                         f"{describe(QKNormConfig.of(overrides['qk_norm']))} was asked for; leave qk_norm out to build "
                         f"the recorded norm (a whole model: load it with "
                         f"qkmla.integrations.transformers.from_pretrained, which restores the norm's weights)")
    if groups is not None and overrides.get("num_kv_groups", groups) != groups:
        raise ValueError(f"num_kv_groups: hf_config records {groups} KV groups in its {RECORD!r} entry; got "
                         f"{overrides['num_kv_groups']!r}; leave num_kv_groups out")
    any_rope_type = overrides.pop("any_rope_type", False)
    overrides.pop("any_model_type", None)
    theta, scaling = hf_rope(hf_config, any_rope_type)
    # V2 and V3.2 always rotate interleaved pairs (V3.2's config has no rope_interleave); V3 does
    # unless rope_interleave is False.
    always = stock_model_type(model_type) in ("deepseek_v2", "deepseek_v32")
    interleave = True if always else bool(_get(hf_config, "rope_interleave", True))
    heads = _get(hf_config, "num_attention_heads")
    fields = dict(
        hidden_size=_get(hf_config, "hidden_size"), num_heads=heads, num_kv_groups=groups or heads,
        q_lora_rank=_get(hf_config, "q_lora_rank", None), kv_lora_rank=_get(hf_config, "kv_lora_rank"),
        qk_nope_head_dim=_get(hf_config, "qk_nope_head_dim"), qk_rope_head_dim=_get(hf_config, "qk_rope_head_dim"),
        v_head_dim=_get(hf_config, "v_head_dim"), rope_theta=theta, rope_interleave=interleave,
        rope_scaling=scaling, attention_bias=bool(_get(hf_config, "attention_bias", False)),
        latent_norm_eps=1e-6,  # HF builds q_a_layernorm / kv_a_layernorm with their default eps
        qk_norm=norm,
    )
    fields.update(overrides)
    try:
        return MLAConfig(**fields)
    except (ValueError, TypeError) as e:  # a field of the HF config named as the config names it, not as MLAConfig
        # does: num_attention_heads=2**70 was refused as "num_heads: ...", a field the config does not have
        field, colon, rest = str(e).partition(": ")
        if colon and field in _HF_NAMES and field not in overrides:
            raise type(e)(f"{_HF_NAMES[field]}: {rest}") from None
        raise


def check_dense(hf_config, name: str) -> None:
    """Refuse a sparse attention model's config (DeepSeek-V3.2: ``index_topk``), naming ``name``: its layers attend
    to the keys their indexer picks, and a standalone :class:`MLA` (no indexer) attends to every key, so the layer
    loaders built a layer computing another function (0.22 off transformers' layer beyond index_topk tokens) without a
    word. The transformers adapter (``SparseLatentAttention``) serves it."""
    model_type, topk = _get(hf_config, "model_type", None), _get(hf_config, "index_topk", None)
    if stock_model_type(model_type) == "deepseek_v32" or topk is not None:
        raise ValueError(f"{name}: a sparse attention model ({model_type!r}, index_topk={topk!r}): each query attends "
                         f"to the index_topk keys its indexer picks, and a standalone MLA layer has no indexer (it "
                         f"would attend to every key); load the whole model with "
                         f"qkmla.integrations.transformers.from_pretrained, or apply_latent_attention(model), which "
                         f"serve its sparse attention")


def load_hf_attention_weights(mla: MLA, state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> MLA:
    """Copy an HF attention layer's weights into ``mla``.

    Args:
        state_dict: an HF attention state dict, or a whole-model one with ``prefix`` such as
            ``"model.layers.3.self_attn."`` (other keys are ignored). One qkmla saved also holds
            the QK-norm weights (``q_norm.*``, ``k_norm.*``, ``logit_scale``), which are copied too;
            without them a norm of ``mla`` keeps its weights (ones: the start of QK-norm training).
            A GQA conversion's ``kv_b_proj``, each group's rows repeated for its heads, is taken once.

    Raises:
        ValueError: a weight is missing or has the wrong shape, or the state dict holds QK-norm
            weights and ``mla`` has no norm (build it with the checkpoint's recorded norm:
            :func:`mla_config_from_hf` reads it).
    """
    own = {k: v for k, v in mla.state_dict().items() if not k.endswith("_extra_state")}
    norm = [k for k in own if k.startswith(_OURS)]
    given = sorted(k for k in state_dict if k.startswith(prefix) and k[len(prefix):].startswith(_OURS)
                   and not k.endswith("_extra_state"))
    if given and not norm:
        raise ValueError(f"state_dict: holds QK-norm weights ({given[0]}, ...: {len(given)}) but this MLA has no QK "
                         f"norm; build it with the norm the checkpoint records (mla_config_from_hf reads "
                         f"config.json's 'qkmla' entry)")
    wanted = [k for k in own if not k.startswith(_OURS) or given]
    missing = [prefix + k for k in wanted if prefix + k not in state_dict]
    if missing:
        raise ValueError(f"state_dict: missing {missing} (prefix={prefix!r})")
    c = mla.config
    sources = {k: state_dict[prefix + k] for k in wanted}
    if c.num_kv_groups < c.num_heads and sources["kv_b_proj.weight"].shape[0] == c.num_heads * (
            c.qk_nope_head_dim + c.v_head_dim):
        sources["kv_b_proj.weight"] = unrepeat_groups(sources["kv_b_proj.weight"], c,
                                                      f"state_dict: {prefix}kv_b_proj.weight")
    for k, src in sources.items():
        if tuple(src.shape) != tuple(own[k].shape):
            raise ValueError(f"state_dict: {prefix + k} has shape {tuple(src.shape)}, this MLA needs "
                             f"{tuple(own[k].shape)}")
    with torch.no_grad():
        for name, p in list(mla.named_parameters()) + list(mla.named_buffers()):
            if name in sources:
                p.copy_(sources[name])
    return mla


HF_PROJECTIONS = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                  "kv_b_proj", "o_proj", "q_gate_proj")  # q_gate_proj: AXK2's fused query and gate (families.py)


def hf_projections(hf_attention) -> dict:
    """The projection and latent-norm modules an HF DeepSeek attention layer has, by name."""
    found = {name: getattr(hf_attention, name, None) for name in HF_PROJECTIONS}
    return {name: module for name, module in found.items() if module is not None}


def unrepeat_groups(weight: torch.Tensor, config: MLAConfig, where: str) -> torch.Tensor:
    """kv_b_proj.weight as transformers' shapes store a GQA conversion's, each of the G groups' rows
    repeated for its heads, [h (d_n + d_v), d_c] -> [G (d_n + d_v), d_c]; refused (naming ``where``)
    unless every head's rows equal its group's first head's exactly."""
    rows = config.qk_nope_head_dim + config.v_head_dim
    G, h = config.num_kv_groups, config.num_heads
    if tuple(weight.shape) != (h * rows, config.kv_lora_rank):
        raise ValueError(f"{where}: has shape {tuple(weight.shape)}; {G} KV groups repeated for {h} heads need "
                         f"{(h * rows, config.kv_lora_rank)}")
    per_head = weight.reshape(G, config.heads_per_group, rows, -1)
    if not bool((per_head == per_head[:, :1]).all()):
        raise ValueError(f"{where}: the config records {G} KV groups, but the rows of the heads of a group are not "
                         f"equal (not a GQA conversion's repeated rows)")
    return per_head[:, 0].reshape(G * rows, -1).clone()


def mla_from_hf(hf_attention, **overrides) -> MLA:
    """A standalone :class:`MLA` with copies of an HF ``DeepseekV2Attention`` / ``DeepseekV3Attention``'s
    projections: the per-layer step of ``apply_latent_attention`` (which adopts the modules
    instead of copying them), with MLA's own call signature. A GQA conversion's recorded KV
    groups are kept (one copy of each group's ``kv_b_proj`` rows).

    Raises:
        ValueError: the layer's config records a QK norm (a checkpoint qkmla saved, loaded by
            transformers alone, which drops the norm weights); load it with
            :func:`~qkmla.integrations.hub.checkpoint.mla_layers_from_hf_dir` or
            ``qkmla.integrations.transformers.from_pretrained``, which restore them.

    Examples:
        >>> mla = mla_from_hf(hf_model.model.layers[0].self_attn)             # doctest: +SKIP
        >>> mla_qk = mla_from_hf(hf_layer, qk_norm="rms")  # start QK-norm training from HF weights  # doctest: +SKIP
    """

    if not isinstance(hf_attention, torch.nn.Module) or not hasattr(hf_attention, "config"):
        # an AttributeError on .config, naming neither the argument nor what it takes
        raise ValueError(f"hf_attention: expected a transformers DeepSeek-V2/V3 attention module (e.g. "
                         f"model.model.layers[0].self_attn), got {type(hf_attention).__name__}")
    check_dense(hf_attention.config, "hf_attention")
    config = mla_config_from_hf(hf_attention.config, **overrides)
    recorded = recorded_norm(hf_attention.config, "hf_attention.config")
    if recorded is not None:
        raise ValueError(f"hf_attention: its config records the QK norm {describe(recorded)} (the {RECORD!r} entry), "
                         f"but the layer has no norm weights (transformers alone drops them); load the checkpoint "
                         f"with qkmla.integrations.hub.mla_layers_from_hf_dir or "
                         f"qkmla.integrations.transformers.from_pretrained")
    weight = next(hf_attention.parameters())
    projections = copy.deepcopy(hf_projections(hf_attention))
    if config.num_kv_groups < config.num_heads:
        kv_b_proj = projections["kv_b_proj"]
        kv_b_proj.weight = torch.nn.Parameter(
            unrepeat_groups(kv_b_proj.weight.detach(), config, "hf_attention: kv_b_proj.weight"),
            requires_grad=kv_b_proj.weight.requires_grad)
        kv_b_proj.out_features = kv_b_proj.weight.shape[0]
    mla = MLA(config, projections)
    return mla.to(device=weight.device, dtype=weight.dtype)
