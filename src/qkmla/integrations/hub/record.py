"""QK-norm on a whole transformers DeepSeek model: what is recorded in its config, the names of its
weights, and the checks that a saved checkpoint's record and tensors agree (loading it back:
``qkmla.integrations.transformers.from_pretrained``, or layer by layer
``qkmla.integrations.hub.mla_layers_from_hf_dir``; ``mla_config_from_hf`` reads the record too).

``apply_latent_attention(model, qk_norm="rms")`` gives every attention layer qkmla's
post-up-projection QK norm and records it in the model's config, so that ``save_pretrained``
writes it to ``config.json``, as the one :class:`~qkmla.QKNormConfig` it is:

    "qkmla": {"qk_norm": {"kind": "rms", "mode": "blockwise", "p": 2.0, "eps": 1e-06,
                          "scope": "head", "learnable_logit_scale": false}}
    "attn_implementation": "qkmla.integrations.transformers.from_pretrained"

(Records written before ``QKNormConfig`` held the same fields flat, ``"qk_norm": "rms",
"qk_norm_mode": ..., "qk_norm_p": ...``; they are read as they always were.)

The norm weights are saved as transformers names QK-norm weights (Qwen3's and OLMo 2's
``self_attn.q_norm.weight``), one level deeper because qkmla's norm has one weight per block:

    model.layers.{i}.self_attn.q_norm.content.weight   [d_n]   gamma_q^C
    model.layers.{i}.self_attn.q_norm.rope.weight      [d_r]   gamma_q^R
    model.layers.{i}.self_attn.k_norm.content.weight   [d_n]   gamma_k^C
    model.layers.{i}.self_attn.k_norm.rope.weight      [d_r]   gamma_k^R
    model.layers.{i}.self_attn.logit_scale             [h]     with learnable_logit_scale

With the projection scope the weights have a row per head: q_norm's [h, d_n] and [h, d_r],
k_norm.content's [G, d_n] (k_norm.rope's stays [d_r]: the RoPE key is one vector).

Every other tensor is transformers' own, under its own name.

A model converted from a GQA model (``qkmla.convert.gqa``) has G < h KV groups, which
transformers' DeepSeek attention cannot express (it builds ``kv_b_proj`` with one group per
head). Its record then also holds ``"num_kv_groups": G``: ``kv_b_proj`` is saved with each
group's rows repeated for each of its heads, as transformers' shapes need, and the patched
layers keep (and cache) G groups (``integrations.transformers.attention``).

A QK-normed checkpoint is a model of its own, and says so: transformers' DeepSeek classes would
load it as a plain model (dropping the norm weights with a note that they "can be ignored") and
compute another function. Its config.json declares qkmla's model type and architecture
(``integrations.transformers.auto``):

    "model_type": "qkmla_deepseek_v3",                       (qkmla_deepseek_v2 for V2)
    "architectures": ["QKNormDeepseekV3ForCausalLM"],
    "auto_map": {"AutoConfig": "modeling_qkmla.QKNormDeepseekV3Config",
                 "AutoModelForCausalLM": "modeling_qkmla.QKNormDeepseekV3ForCausalLM"}

with ``modeling_qkmla.py`` beside it (it imports those classes from the installed qkmla), so
transformers with qkmla imported loads it with its norm, ``trust_remote_code=True`` loads it where
qkmla is installed but not imported, and an engine that knows neither refuses it by name. The
``attn_implementation`` entry stays as a second guard: a DeepSeek class called directly refuses it,
quoting the entry, which names the loader to call. A model without a norm keeps transformers' own
model type (a GQA conversion without a norm too: transformers alone computes its function).

Checkpoints written before the model type of their own (``"model_type": "deepseek_v3"`` with the
record) are read as they always were; saving them again writes the model type above.

Nothing here imports transformers at module level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from ...config import MLAConfig, QKNormConfig
from ...norms import qk_norms_of
from .checkpoint import CONFIG, _open, _weight_map, read_hf_config

RECORD = "qkmla"  # the config.json entry
# written as attn_implementation: transformers alone refuses it
LOADER = "qkmla.integrations.transformers.from_pretrained"
NORM = "qk_norm"  # the record's QK norm: QKNormConfig.record()
GROUPS = "num_kv_groups"  # recorded beside the norm by a GQA conversion: G < h KV groups
# A record written before QKNormConfig: the norm's fields, flat, by these names.
FLAT_FIELDS = {"qk_norm": "kind", "qk_norm_mode": "mode", "qk_norm_p": "p", "qk_norm_eps": "eps",
               "qk_norm_scope": "scope", "learnable_logit_scale": "learnable_logit_scale"}
_FLAT_NAMES = {field: key for key, field in FLAT_FIELDS.items()}
# A QK-normed checkpoint's own model type and architecture, by transformers' (a plain model keeps those)
QK_MODEL_TYPES = {"deepseek_v2": "qkmla_deepseek_v2", "deepseek_v3": "qkmla_deepseek_v3"}
QK_ARCHITECTURES = {"DeepseekV2ForCausalLM": "QKNormDeepseekV2ForCausalLM",
                    "DeepseekV3ForCausalLM": "QKNormDeepseekV3ForCausalLM"}
CODE = "modeling_qkmla"  # the file beside config.json that auto_map names (it imports qkmla's classes)


def stock_model_type(model_type):
    """transformers' model type for one of qkmla's (``qkmla_deepseek_v3`` -> ``deepseek_v3``); any
    other value unchanged."""
    return next((stock for stock, ours in QK_MODEL_TYPES.items() if ours == model_type), model_type)


def _model_type(hf_config):
    return hf_config.get("model_type") if isinstance(hf_config, dict) else getattr(hf_config, "model_type", None)


def _record(hf_config):
    return hf_config.get(RECORD) if isinstance(hf_config, dict) else getattr(hf_config, RECORD, None)


def recorded_norm(hf_config, where: str = "model.config") -> Optional[QKNormConfig]:
    """The QK norm recorded in an HF config (object or config.json dict), checked; None if none.
    qkmla's model types (``qkmla_deepseek_v3``) are QK-normed checkpoints' only: one without a norm
    recorded is refused."""
    norm = _recorded_norm(hf_config, where)
    model_type = _model_type(hf_config)
    if norm is None and model_type in QK_MODEL_TYPES.values():
        raise ValueError(f"{where}: model_type {model_type!r} is a QK-normed checkpoint's, but its {RECORD!r} entry "
                         f"records no QK norm; a model without one is a {stock_model_type(model_type)!r} model")
    return norm


def _recorded_norm(hf_config, where: str) -> Optional[QKNormConfig]:
    record = _record(hf_config)
    if record is None:
        return None
    allowed = {NORM, GROUPS} if isinstance(record, dict) and isinstance(record.get(NORM), dict) \
        else set(FLAT_FIELDS) | {GROUPS}
    if not isinstance(record, dict) or set(record) - allowed:
        extra = sorted(set(record) - allowed) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: its {RECORD!r} entry must be a dict of {NORM!r} (the QK norm's fields) and "
                         f"{GROUPS!r}, got {extra}")
    try:
        if isinstance(record.get(NORM), dict):
            return QKNormConfig.of(record[NORM])
        flat = {FLAT_FIELDS[k]: v for k, v in record.items() if k in FLAT_FIELDS}
        if flat.get("kind") is None:  # as flat records were read: no norm; only a learned scale counts
            flat = {"kind": None, **{k: v for k, v in flat.items() if k == "learnable_logit_scale"}}
        try:
            return QKNormConfig.of(flat) if flat else None
        except ValueError as e:  # named by the record's own key
            field, _, rest = str(e).partition(": ")
            raise ValueError(f"{_FLAT_NAMES.get(field, field)}: {rest}") from None
    except ValueError as e:
        raise ValueError(f"{where}: its {RECORD!r} entry is not valid: {e}") from None


def recorded_groups(hf_config, where: str = "model.config") -> Optional[int]:
    """The KV group count G a GQA conversion recorded in an HF config (object or config.json
    dict), checked against its num_attention_heads; None if none is recorded."""
    record = _record(hf_config)
    groups = record.get(GROUPS) if isinstance(record, dict) else None
    if groups is None:
        return None
    heads = hf_config.get("num_attention_heads") if isinstance(hf_config, dict) else hf_config.num_attention_heads
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or heads % groups:
        raise ValueError(f"{where}: its {RECORD!r} entry records {GROUPS}={groups!r}, which must be a positive int "
                         f"dividing num_attention_heads={heads}")
    return groups


def record_norm(hf_config, norm: Optional[QKNormConfig]) -> None:
    """Write (or clear, for None) the record of ``norm`` in an HF config object; a recorded
    ``num_kv_groups`` is kept. A transformers ``DeepseekV2Config`` / ``DeepseekV3Config`` with a norm
    becomes qkmla's subclass of it (``integrations.transformers.auto``: the same fields, qkmla's model
    type, and ``save_pretrained`` writes the architecture and ``auto_map``); without one, transformers'
    own class again. Any other object (a plain namespace written out as config.json) only gets the
    record and ``attn_implementation``."""
    groups = recorded_groups(hf_config)
    kept = {GROUPS: groups} if groups is not None else {}
    if norm is not None:
        setattr(hf_config, RECORD, {NORM: norm.record(), **kept})
        hf_config.attn_implementation = LOADER
    else:
        for name in (RECORD, "attn_implementation"):
            if name in hf_config.__dict__:
                delattr(hf_config, name)
        if kept:  # a GQA conversion without a norm: transformers alone computes the same function
            setattr(hf_config, RECORD, kept)
    _declare(hf_config, norm is not None)


def _declare(hf_config, normed: bool) -> None:
    """Give a transformers DeepSeek config object qkmla's subclass of its class when its model has a QK
    norm (``integrations.transformers.auto``, found among the class's subclasses: hub does not import
    the adapter, and the adapter is imported wherever a model is patched), transformers' own when it
    has none. The subclass has the same fields: only the model type and how it is saved change. Any
    other class (a namespace, someone else's subclass) is left as it is."""
    cls = type(hf_config)
    model_type = getattr(cls, "model_type", None)  # a class attribute: a transformers config
    if normed and model_type in QK_MODEL_TYPES and cls.__module__.startswith("transformers."):
        ours = [c for c in cls.__subclasses__() if getattr(c, "model_type", None) == QK_MODEL_TYPES[model_type]]
        if ours:
            hf_config.__class__ = ours[0]
    elif not normed and model_type in QK_MODEL_TYPES.values():
        hf_config.__class__ = next(c for c in cls.__mro__ if c.__dict__.get("model_type") ==
                                   stock_model_type(model_type))


def record_groups(hf_config, groups: int) -> None:
    """Record that a model's layers have ``groups`` KV groups (GQA conversions), beside any norm."""
    setattr(hf_config, RECORD, {**(getattr(hf_config, RECORD, None) or {}), GROUPS: groups})
    recorded_groups(hf_config)


def norm_tensor_shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    """{name under ``self_attn.``: shape} of the weights a layer with ``config``'s norm adds, read from
    the norms it builds (with the projection scope a weight has a row per query head or KV group)."""
    q_norm, k_norm = qk_norms_of(config)
    shapes = {f"{side}.{block}.weight": tuple(getattr(norm, block).weight.shape)
              for side, norm in (("q_norm", q_norm), ("k_norm", k_norm)) if norm is not None
              for block in ("content", "rope")}
    return shapes | ({"logit_scale": (config.num_heads,)} if config.learnable_logit_scale else {})


def check_norm_tensors(hf_dir: Union[str, Path], hf_config: dict, norm: Optional[QKNormConfig]) -> dict[str, str]:
    """Before any weight is read: the checkpoint holds exactly the norm weights its config records,
    with the right shapes (from the safetensors headers). Returns {tensor name: shard file}.

    Raises:
        ValueError: naming the file, for a norm recorded whose weights are missing, norm weights
            whose norm is not recorded, or a weight of the wrong shape.
    """
    from .config import mla_config_from_hf

    root = Path(hf_dir)
    weight_map, listing = _weight_map(root)
    ours = ("self_attn.q_norm.", "self_attn.k_norm.", "self_attn.logit_scale")
    found = {k for k in weight_map if any(o in k for o in ours)}
    groups = recorded_groups(hf_config, str(root / CONFIG))
    config = mla_config_from_hf(hf_config, qk_norm=norm, **({GROUPS: groups} if groups is not None else {}))
    layers = hf_config.get("num_hidden_layers")
    shapes = {f"model.layers.{i}.self_attn.{n}": s
              for i in range(layers) for n, s in norm_tensor_shapes(config).items()}
    if norm is None and found:
        raise ValueError(f"hf_dir: {listing} holds QK-norm weights ({sorted(found)[0]}, ...: {len(found)}) but "
                         f"{root / CONFIG} records no norm (its {RECORD!r} entry is missing); the config and the "
                         f"weights are from different models")
    records = {k for k in found if k.endswith("._extra_state")}  # the variant record of each norm (optional)
    found -= records
    missing, extra = sorted(set(shapes) - found), sorted(found - set(shapes))
    if missing or extra:
        raise ValueError(f"hf_dir: {root / CONFIG} records the norm {describe(norm)} but {listing} "
                         + (f"lacks {missing[:3]}{' ...' if len(missing) > 3 else ''} ({len(missing)} missing)"
                            if missing else f"also holds {extra[:3]} ({len(extra)} not of that norm)"))
    files = {}
    for name, shape in shapes.items():
        file = weight_map[name]
        if not (root / file).is_file():
            raise ValueError(f"hf_dir: {listing} names shard file {file}, which is not in {root}")
        with _open(root / file) as f:
            got = tuple(f.get_slice(name).get_shape())
        if got != shape:
            raise ValueError(f"hf_dir: {root / file}: {name} has shape {got}; the config in {root / CONFIG} needs "
                             f"{shape}")
        files[name] = file
    if records:
        want = norm.name if norm is not None and norm.kind is not None else None
        for name in sorted(records):
            with _open(root / weight_map[name]) as f:
                got = bytes(f.get_tensor(name).tolist()).decode("ascii", "replace")
            if got != want:
                raise ValueError(f"hf_dir: {root / weight_map[name]}: {name} says its weights belong to a {got} QK "
                                 f"norm, but {root / CONFIG} records {describe(norm)}")
    return files


def saved_norm(hf_dir: Union[str, Path]) -> Optional[QKNormConfig]:
    """The QK norm a checkpoint directory's config.json records (None for none)."""
    root = Path(hf_dir)
    return recorded_norm(read_hf_config(root), str(root / CONFIG))


def describe(norm: Optional[QKNormConfig]) -> str:
    """One line naming a recorded norm, e.g. ``rms blockwise``."""
    if norm is None:
        return "no QK norm"
    return norm.name + (", learnable logit scale" if norm.learnable_logit_scale else "")


__all__ = ["CODE", "FLAT_FIELDS", "GROUPS", "LOADER", "NORM", "QK_ARCHITECTURES", "QK_MODEL_TYPES", "RECORD",
           "check_norm_tensors", "describe", "record_groups", "recorded_groups", "recorded_norm", "saved_norm",
           "stock_model_type"]
