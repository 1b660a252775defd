"""QK-norm on a whole transformers DeepSeek model: what is recorded in its config and how the
checkpoint declares itself (the checks that a saved checkpoint's record and tensors agree are
``checkpoint.check_norm_tensors``, which reads files; loading it back:
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

The other MLA families of transformers (``integrations.transformers.families``) declare themselves
the same way, as ``qkmla_<model_type>`` and ``QKNorm<CausalLM>``: ``integrations.transformers.auto``
builds their classes and enters them in ``FAMILY_MODEL_TYPES`` / ``FAMILY_ARCHITECTURES``.

Checkpoints written before the model type of their own (``"model_type": "deepseek_v3"`` with the
record) are read as they always were; saving them again writes the model type above.

Nothing here imports transformers at module level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ...config import QKNormConfig
from ...utils.checked import is_int

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
# Every MLA family's QK-normed model type and architecture: DeepSeek's above (which the vLLM and
# torchtitan integrations serve), and those ``integrations.transformers.auto`` adds when it builds
# the other families' classes from the table of families (``integrations.transformers.families``).
FAMILY_MODEL_TYPES = dict(QK_MODEL_TYPES)
FAMILY_ARCHITECTURES = dict(QK_ARCHITECTURES)
CAUSAL_LMS = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


CODE_TEXT = '''"""This checkpoint's model is qkmla's QK-normed DeepSeek (https://pypi.org/project/qkmla/): its
attention layers carry a QK norm that transformers' own DeepSeek classes do not compute, so it
declares a model type of its own. Its classes are qkmla's; this file only imports them, so
``trust_remote_code=True`` loads the checkpoint where qkmla is installed (pip install "qkmla[hf]"),
and with ``import qkmla.integrations.transformers`` it loads without trust_remote_code."""

from qkmla.integrations.transformers.auto import (  # noqa: F401
    QKNormDeepseekV2Config,
    QKNormDeepseekV2ForCausalLM,
    QKNormDeepseekV3Config,
    QKNormDeepseekV3ForCausalLM,
)
from qkmla.integrations.transformers.auto import *  # noqa: F401,F403  (the other MLA families' classes)
'''


def write_code(directory) -> Path:
    """Write ``modeling_qkmla.py`` (what config.json's ``auto_map`` names) into ``directory``."""
    path = Path(directory) / f"{CODE}.py"
    path.write_text(CODE_TEXT)
    return path


def declaration(model_type: str, architectures: Optional[list] = None) -> dict:
    """The config.json fields that declare a QK-normed checkpoint of a DeepSeek ``model_type`` (stock
    or qkmla's): qkmla's model type, ``architectures`` with qkmla's names for DeepSeek's causal LMs
    (default: the causal LM), and the ``auto_map`` naming the classes in ``modeling_qkmla.py``."""
    stock = stock_model_type(model_type)
    model = FAMILY_ARCHITECTURES[CAUSAL_LMS[stock]]
    return {"model_type": FAMILY_MODEL_TYPES[stock],
            "architectures": [FAMILY_ARCHITECTURES.get(a, a) for a in architectures or [model]],
            "auto_map": {"AutoConfig": f"{CODE}.{model.removesuffix('ForCausalLM')}Config",
                         "AutoModelForCausalLM": f"{CODE}.{model}"}}


def stock_model_type(model_type):
    """transformers' model type for one of qkmla's (``qkmla_deepseek_v3`` -> ``deepseek_v3``); any
    other value unchanged."""
    return next((stock for stock, ours in FAMILY_MODEL_TYPES.items() if ours == model_type), model_type)


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
    if norm is None and model_type in FAMILY_MODEL_TYPES.values():
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
            return QKNormConfig.of(record[NORM], NORM)
        flat = {FLAT_FIELDS[k]: v for k, v in record.items() if k in FLAT_FIELDS}
        if flat.get("kind") is None:  # as flat records were read: no norm; only a learned scale counts
            flat = {"kind": None, **{k: v for k, v in flat.items() if k == "learnable_logit_scale"}}
        try:
            return QKNormConfig.of(flat) if flat else None
        except ValueError as e:  # named by the record's own key
            field, _, rest = str(e).removeprefix("qk_norm.").partition(": ")
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
    if not is_int(heads) or heads < 1:  # None or "4" failed in the % below (a TypeError naming nothing); 0, -4 and
        # 4.0 passed as divided by the groups
        raise ValueError(f"{where}: num_attention_heads must be a positive int (the query heads its {RECORD!r} "
                         f"entry's {GROUPS}={groups!r} divides), got {heads!r}")
    if not is_int(groups) or groups < 1 or heads % groups:
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
    if normed and model_type in FAMILY_MODEL_TYPES and cls.__module__.startswith("transformers."):
        ours = [c for c in cls.__subclasses__() if getattr(c, "model_type", None) == FAMILY_MODEL_TYPES[model_type]]
        if ours:
            hf_config.__class__ = ours[0]
    elif not normed and model_type in FAMILY_MODEL_TYPES.values():
        hf_config.__class__ = next(c for c in cls.__mro__ if c.__dict__.get("model_type") ==
                                   stock_model_type(model_type))


def record_groups(hf_config, groups: int) -> None:
    """Record that a model's layers have ``groups`` KV groups (GQA conversions), beside any norm."""
    setattr(hf_config, RECORD, {**(getattr(hf_config, RECORD, None) or {}), GROUPS: groups})
    recorded_groups(hf_config)


def describe(norm: Optional[QKNormConfig]) -> str:
    """One line naming a recorded norm, e.g. ``rms blockwise``."""
    if norm is None:
        return "no QK norm"
    return norm.name + (", learnable logit scale" if norm.learnable_logit_scale else "")


__all__ = ["CAUSAL_LMS", "CODE", "CODE_TEXT", "FAMILY_ARCHITECTURES", "FAMILY_MODEL_TYPES", "FLAT_FIELDS",
           "GROUPS", "LOADER", "NORM", "QK_ARCHITECTURES", "QK_MODEL_TYPES",
           "RECORD", "declaration", "describe", "record_groups", "recorded_groups", "recorded_norm", "stock_model_type",
           "write_code"]
