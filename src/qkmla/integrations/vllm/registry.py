"""What the plugin registers with vLLM (``register`` runs this in every vLLM process, once the
installed vLLM's version is one it supports).

* qkmla's model types in transformers (``integrations.transformers.auto``): vLLM reads config.json
  through ``AutoConfig``, which knows ``qkmla_deepseek_v3`` / ``qkmla_deepseek_v2`` only once they
  are registered, in the process that reads it;
* qkmla's architectures, ``QKNormDeepseekV3ForCausalLM`` / ``QKNormDeepseekV2ForCausalLM``, with
  vLLM's ``ModelRegistry`` (``model.py``). vLLM's own DeepSeek architectures stay vLLM's;
* how vLLM reads qkmla's model types: it recognises a DeepSeek MLA model (the latent cache, the
  MLA backends) by its model type, so each of qkmla's gets a ``ModelArchConfigConvertor`` that
  answers as for DeepSeek's;
* qkmla's attention backends by name in vLLM's backend registries (``register_backend``,
  ``register_mla_prefill_backend``): ``QKMLA_CPU`` and ``QKMLA_TRITON`` (what
  ``--attention-backend`` takes for a QK-normed checkpoint, ``checks.py``) and the CPU prefill
  ``QKMLA_CPU_SDPA``; the QK-normed layers take them from there;
* checkpoints qkmla wrote before it declared its own architecture (model type ``deepseek_v3`` with
  a ``"qkmla"`` record): the convertor vLLM uses for DeepSeek's model types gives them qkmla's
  architecture, so they are served with their norm, not by vLLM's class without it. A checkpoint
  without the record is read exactly as vLLM's own convertor reads it.
"""

from __future__ import annotations

import importlib

from . import installed  # noqa: F401  (first: a clear line when vLLM is missing or unsupported)
from vllm import ModelRegistry
from vllm.transformers_utils import model_arch_config_convertor as convertors

from ..hub.record import QK_ARCHITECTURES, QK_MODEL_TYPES, RECORD

MODEL_MODULE = "qkmla.integrations.vllm.model"
BACKEND_MODULE = "qkmla.integrations.vllm.backend"
# qkmla's attention backends by the name vLLM's registry knows them (the class each names is made
# on first use: backend.py's module __getattr__)
ATTENTION_BACKENDS = {"QKMLA_CPU": f"{BACKEND_MODULE}.QKMLACPUBackend", "QKMLA_TRITON": f"{BACKEND_MODULE}.QKMLATritonBackend"}
PREFILL_BACKENDS = {"QKMLA_CPU_SDPA": f"{BACKEND_MODULE}.QKMLACPUPrefillBackend"}


def register_all() -> None:
    """Everything above; idempotent."""
    importlib.import_module("qkmla.integrations.transformers.auto")  # AutoConfig knows qkmla's model types
    for ours in QK_ARCHITECTURES.values():
        ModelRegistry.register_model(ours, f"{MODEL_MODULE}:{ours}")
    registered = convertors.MODEL_ARCH_CONFIG_CONVERTORS
    for stock, ours in QK_MODEL_TYPES.items():
        base = registered.get(stock, convertors.ModelArchConfigConvertorBase)
        base = getattr(base, "qkmla_base", base)  # registered before, by this function
        registered[ours] = _as_deepseek(base)
        registered[stock] = _earlier_checkpoints(base)
    register_backends()


def register_backends() -> None:
    """qkmla's backends in vLLM's attention and MLA prefill registries, under their names; idempotent."""
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, path in ATTENTION_BACKENDS.items():
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)
    for name, path in PREFILL_BACKENDS.items():
        if name not in MLAPrefillBackendEnum.__members__:
            register_mla_prefill_backend(name, path)


def registered_backend(name: str) -> type:
    """The class vLLM's registry holds for one of qkmla's backend names (``ATTENTION_BACKENDS``)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    register_backends()
    return AttentionBackendEnum[name].get_class()


def _as_deepseek(base: type) -> type:
    class QKNormDeepseekArchConfigConvertor(base):
        """vLLM's reading of a DeepSeek config, for qkmla's model type of it."""

        qkmla_base = base

        def is_deepseek_mla(self) -> bool:
            # what vLLM answers for deepseek_v2 / deepseek_v3 (its list of MLA model types)
            return getattr(self.hf_text_config, "kv_lora_rank", None) is not None

    return QKNormDeepseekArchConfigConvertor


def _earlier_checkpoints(base: type) -> type:
    class EarlierQKNormCheckpointArchConfigConvertor(base):
        """vLLM's reading of a DeepSeek config; one with qkmla's record (written before QK-normed
        checkpoints declared their own architecture) gets qkmla's architecture.

        vLLM reads the architecture twice: its ``ModelConfig`` from this convertor, its model loader
        from the config object itself (``hf_config.architectures``, ``get_model_architecture``). So
        the name is changed in that object, vLLM's copy of the checkpoint's config.json, which vLLM
        builds before anything else reads it (``ModelConfig.__post_init__``) and hands to every
        process; this convertor's answer then follows from it."""

        qkmla_base = base

        def __init__(self, hf_config, hf_text_config, *args, **kwargs):
            super().__init__(hf_config, hf_text_config, *args, **kwargs)
            architectures = getattr(hf_config, "architectures", None)
            if getattr(hf_config, RECORD, None) is not None and architectures:
                hf_config.architectures = [QK_ARCHITECTURES.get(name, name) for name in architectures]

    return EarlierQKNormCheckpointArchConfigConvertor
