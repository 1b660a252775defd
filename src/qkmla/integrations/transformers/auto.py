"""A QK-normed checkpoint's own architecture in transformers: ``QKNormDeepseekV3ForCausalLM`` (and V2).

A model with qkmla's QK norm computes another function than transformers' DeepSeek classes, so its
checkpoint does not claim to be one. ``apply_latent_attention(model, qk_norm=...)`` records the norm
(``qkmla.integrations.hub.record``), and its config becomes :class:`QKNormDeepseekV3Config`, a
``DeepseekV3Config`` with qkmla's model type. ``save_pretrained`` then writes

    "model_type": "qkmla_deepseek_v3",
    "architectures": ["QKNormDeepseekV3ForCausalLM"],
    "auto_map": {"AutoConfig": "modeling_qkmla.QKNormDeepseekV3Config",
                 "AutoModelForCausalLM": "modeling_qkmla.QKNormDeepseekV3ForCausalLM"},
    "qkmla": {"qk_norm": {...}}, "attn_implementation": "qkmla.integrations.transformers.from_pretrained"

and ``modeling_qkmla.py`` beside config.json, which only imports these classes from the installed
qkmla. So:

* with qkmla's transformers integration imported (it registers both classes with ``AutoConfig`` and
  ``AutoModelForCausalLM``), ``AutoModelForCausalLM.from_pretrained(dir or repo id)`` and
  ``pipeline("text-generation", model=...)`` load the model with its norm;
* where qkmla is installed but not imported, ``trust_remote_code=True`` does (the file imports it);
* transformers without qkmla refuses the model type, asking for ``trust_remote_code``, and a
  DeepSeek class called directly refuses the recorded ``attn_implementation``; an engine that
  knows neither refuses the architecture by name.

:class:`QKNormDeepseekV3ForCausalLM` adds no layer of its own: ``from_pretrained`` is
``qkmla.integrations.transformers.from_pretrained`` (transformers' DeepSeek model, qkmla's latent
attention with the recorded norm, the norm's weights), and a model built from a config
(``from_config``) is transformers' DeepSeek model patched with the recorded norm (weights at ones).
A model without a norm keeps transformers' own config class and saves as a stock DeepSeek
checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from transformers import (AutoConfig, AutoModelForCausalLM, DeepseekV2Config, DeepseekV2ForCausalLM,
                          DeepseekV3Config, DeepseekV3ForCausalLM)

from ..hub.checkpoint import CONFIG
from ..hub.record import (CODE_TEXT, FAMILY_MODEL_TYPES, LOADER, QK_MODEL_TYPES, RECORD, declaration,  # noqa: F401
                          recorded_norm, write_code)

# What older checkpoints record as attn_implementation: qkmla's loader, under its names then and now.
_LOADERS = (LOADER, "qkmla.interop.from_pretrained")

class _QKNormConfig:
    """What qkmla's config classes add to transformers' DeepSeek config: how they are written."""

    def to_dict(self) -> dict:
        return self._declared(super().to_dict())

    def to_diff_dict(self) -> dict:
        return self._declared(super().to_diff_dict())

    def _declared(self, output: dict) -> dict:
        """A serialized config with qkmla's model type, architecture and auto_map."""
        output.update(declaration(type(self).model_type, output.get("architectures")))
        return output

    def to_json_file(self, json_file_path, use_diff: bool = True):
        """Write the config; written as a checkpoint's config.json, the code ``auto_map`` names goes beside it."""
        super().to_json_file(json_file_path, use_diff=use_diff)
        if Path(json_file_path).name == CONFIG:
            write_code(Path(json_file_path).parent)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """Nothing: these classes are installed with qkmla (transformers would copy this module into
        every checkpoint saved after a ``trust_remote_code`` load)."""


class QKNormDeepseekV2Config(_QKNormConfig, DeepseekV2Config):
    """transformers' ``DeepseekV2Config`` of a model with qkmla's QK norm (its ``"qkmla"`` record)."""

    model_type = QK_MODEL_TYPES["deepseek_v2"]


class QKNormDeepseekV3Config(_QKNormConfig, DeepseekV3Config):
    """transformers' ``DeepseekV3Config`` of a model with qkmla's QK norm (its ``"qkmla"`` record)."""

    model_type = QK_MODEL_TYPES["deepseek_v3"]


def _no_norm(cls, what: str) -> None:
    """Refuse a model of a QK-normed architecture without a norm: it would compute the plain model's function
    under a name that says it has one."""
    stock = next(base.__name__ for base in cls.__mro__[1:] if base.__module__.startswith("transformers."))
    raise ValueError(f"{what}, and {cls.__name__} is the architecture of a QK-normed checkpoint; build {stock} for a "
                     f"model without a norm, or add one: apply_latent_attention({stock}(config), qk_norm='rms') "
                     f"(its config then records it)")


class _QKNormCausalLM:
    """transformers' DeepSeek causal LM with qkmla's latent attention and the QK norm its config records."""

    def __init__(self, config, *args, **kwargs):
        from .model import apply_latent_attention

        from ..hub.config import rope_theta

        norm = recorded_norm(config, "config")  # refuses qkmla's model type without a norm
        if norm is None:  # a stock config (no record) built the plain model under this name, without a word
            _no_norm(type(self), f"config: this {type(config).__name__} records no QK norm (no {RECORD!r} entry)")
        rope_theta(config)  # "abc" failed in transformers' RoPE table below, naming nothing
        if config._attn_implementation in _LOADERS:  # the record's guard, not an implementation
            config._attn_implementation = None
        super().__init__(config, *args, **kwargs)
        apply_latent_attention(self, qk_norm=norm)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """``qkmla.integrations.transformers.from_pretrained`` (a directory, or a hub repo id with
        ``revision``, ``cache_dir``, ...), as an instance of this class.

        An ``attn_implementation`` given to ``AutoModelForCausalLM`` or ``pipeline`` goes into the
        config they pass here, and is replaced: the attention is qkmla's latent attention, with the
        norm (before qkmla's model type, such a call loaded the plain model). Given here directly, it is
        refused, as ``from_pretrained`` refuses it."""
        from .load import from_pretrained

        if model_args:
            raise ValueError(f"model_args: {cls.__name__}.from_pretrained takes its arguments by name "
                             f"(qkmla.integrations.transformers.from_pretrained), got {len(model_args)} positional")
        loaded = from_pretrained(pretrained_model_name_or_path, **kwargs)
        model, info = loaded if kwargs.get("output_loading_info") else (loaded, None)  # transformers' (model, info)
        if recorded_norm(model.config, "config") is None:  # a plain checkpoint: loaded without a norm, unsaid
            _no_norm(cls, f"pretrained_model_name_or_path: {pretrained_model_name_or_path} records no QK norm (its "
                          f"config.json has no {RECORD!r} entry)")
        want = cls.__mro__[cls.__mro__.index(_QKNormCausalLM) + 1]  # transformers' class this one extends
        if type(model) is not want:
            raise ValueError(f"pretrained_model_name_or_path: {pretrained_model_name_or_path} holds a "
                             f"{type(model).__name__}, not a {want.__name__}; load it with AutoModelForCausalLM")
        model.__class__ = cls  # adds no state: the same model, under the architecture it declares
        return (model, info) if kwargs.get("output_loading_info") else model

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """Nothing: these classes are installed with qkmla (see the config's)."""


class QKNormDeepseekV2ForCausalLM(_QKNormCausalLM, DeepseekV2ForCausalLM):
    """A QK-normed DeepSeek-V2 checkpoint's architecture: ``DeepseekV2ForCausalLM`` with qkmla's latent
    attention and the recorded QK norm."""

    config_class = QKNormDeepseekV2Config


class QKNormDeepseekV3ForCausalLM(_QKNormCausalLM, DeepseekV3ForCausalLM):
    """A QK-normed DeepSeek-V3 checkpoint's architecture: ``DeepseekV3ForCausalLM`` with qkmla's latent
    attention and the recorded QK norm."""

    config_class = QKNormDeepseekV3Config


_MODELS = {QKNormDeepseekV2Config: QKNormDeepseekV2ForCausalLM, QKNormDeepseekV3Config: QKNormDeepseekV3ForCausalLM}


def _family_classes() -> dict:
    """``QKNorm<Family>Config`` / ``QKNorm<Family>ForCausalLM`` for every other supported MLA family
    of the installed transformers (``families.FAMILIES``: a family with causal-LM classes of its
    own), made as the DeepSeek ones above are written, and entered in the record's tables
    (``hub.record.FAMILY_MODEL_TYPES``, ``FAMILY_ARCHITECTURES``, ``CAUSAL_LMS``) so that a
    QK-normed model of the family declares them when saved."""
    import transformers

    from ..hub import record
    from .families import FAMILIES

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    made = {}
    for family in FAMILIES:
        base = getattr(transformers, family.causal_lm, None)
        if family.status == "supported" and base is not None and base.config_class.model_type != family.model_type \
                and family.model_type in CONFIG_MAPPING:
            # built with another family's classes (Sarvam-MLA: DeepSeek-V3's, its own config): no QK-normed classes
            # of its own, but from_pretrained loads it (it refused "describes a 'sarvam_mla' model")
            record.CAUSAL_LMS.setdefault(family.model_type, family.causal_lm)
        if family.status != "supported" or base is None or base.config_class.model_type != family.model_type \
                or family.model_type in record.QK_MODEL_TYPES:
            continue  # not taken, not installed, built with another family's classes, or written above
        stem = family.causal_lm.removesuffix("ForCausalLM")
        ours = f"qkmla_{family.model_type}"
        config = type(f"QKNorm{stem}Config", (_QKNormConfig, base.config_class),
                      {"model_type": ours, "__module__": __name__,
                       "__doc__": f"transformers' ``{base.config_class.__name__}`` of a model with qkmla's QK norm."})
        model = type(f"QKNorm{family.causal_lm}", (_QKNormCausalLM, base),
                     {"config_class": config, "__module__": __name__,
                      "__doc__": f"``{family.causal_lm}`` with qkmla's latent attention and the recorded QK norm."})
        made[config] = model
        record.FAMILY_MODEL_TYPES[family.model_type] = ours
        record.FAMILY_ARCHITECTURES[family.causal_lm] = model.__name__
        record.CAUSAL_LMS[family.model_type] = family.causal_lm
    return made


_FAMILY_MODELS = _family_classes()
globals().update({cls.__name__: cls for pair in _FAMILY_MODELS.items() for cls in pair})
_MODELS.update(_FAMILY_MODELS)


def register() -> None:
    """Register qkmla's config and model classes with transformers' Auto classes, and give qkmla's
    model types transformers' weight conversions of the DeepSeek model types (the MoE experts' layout);
    done when ``qkmla.integrations.transformers`` is imported. Idempotent."""
    from transformers import conversion_mapping

    for config, model in _MODELS.items():
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModelForCausalLM.register(config, model, exist_ok=True)
    for stock, ours in FAMILY_MODEL_TYPES.items():
        mapping = conversion_mapping.get_checkpoint_conversion_mapping(stock)
        if mapping is not None:
            conversion_mapping.register_checkpoint_conversion_mapping(ours, mapping, overwrite=True)


register()

__all__ = ["CODE_TEXT", "QKNormDeepseekV2Config", "QKNormDeepseekV2ForCausalLM", "QKNormDeepseekV3Config",
           "QKNormDeepseekV3ForCausalLM", "register", "write_code",
           *sorted(cls.__name__ for pair in _FAMILY_MODELS.items() for cls in pair)]
