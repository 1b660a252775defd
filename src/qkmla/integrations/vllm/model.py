"""qkmla's architectures in vLLM: vLLM's DeepSeek-V2/V3 model classes, serving a checkpoint's recorded QK norm.

Registered under qkmla's own architecture names (``registry.py``): ``QKNormDeepseekV3ForCausalLM``
and ``QKNormDeepseekV2ForCausalLM``, which a QK-normed checkpoint declares (and which a checkpoint
qkmla wrote before it declared them is given, from its ``"qkmla"`` record). vLLM's own DeepSeek
classes serve every other DeepSeek checkpoint. vLLM's DeepSeek attention builds its MLA layer
(vLLM's pluggable ``MultiHeadLatentAttentionWrapper``) as
:class:`~qkmla.integrations.vllm.attention.QKNormLatentAttention` while this model is built
(``attention.qk_normed_mla_layers``; a record without a norm or logit scale, a GQA conversion's,
leaves vLLM's layers). The checkpoint's norm
tensors (``integrations.hub.record``) load into the new layers:

    model.layers.{i}.self_attn.q_norm.{content,rope}.weight  ->  ...self_attn.mla_attn.q_norm...
    model.layers.{i}.self_attn.k_norm.{content,rope}.weight  ->  ...self_attn.mla_attn.k_norm...
    model.layers.{i}.self_attn.logit_scale                   ->  ...self_attn.mla_attn.logit_scale
    model.layers.{i}.self_attn.{q,k}_norm._extra_state       checked against the record, not loaded

vLLM's loader refuses a checkpoint that lacks any of them (weights "not initialized").
"""

from __future__ import annotations

from typing import Iterable

import torch

from . import installed  # noqa: F401  (first: a clear line when vLLM is missing or unsupported)
from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from vllm.platforms import current_platform

from ..hub.record import RECORD
from .attention import QKNormLatentAttention, qk_normed_mla_layers
from .backend import BACKEND_NAMES, BACKENDS
from .checks import servable_norm
from .registry import registered_backend

_NORM_TENSORS = (".self_attn.q_norm.", ".self_attn.k_norm.", ".self_attn.logit_scale")


def _settings(vllm_config) -> dict:
    from vllm import envs

    c = vllm_config
    kinds = c.attention_config.backend_per_kind or {}
    backend = kinds.get("mla_attention", c.attention_config.backend)  # what vLLM would pick for MLA layers
    return dict(platform=current_platform.device_type, kv_cache_dtype=c.cache_config.cache_dtype,
                quantization=c.model_config.quantization,
                chunked_prefill=bool(c.scheduler_config.enable_chunked_prefill),
                prefix_caching=bool(c.cache_config.enable_prefix_caching),
                decode_context_parallel_size=c.parallel_config.decode_context_parallel_size,
                prefill_context_parallel_size=c.parallel_config.prefill_context_parallel_size,
                dtype=str(c.model_config.dtype).removeprefix("torch."), speculative=c.speculative_config is not None,
                lora=c.lora_config is not None, mla_disabled=bool(envs.VLLM_MLA_DISABLE) or not c.model_config.use_mla,
                attention_backend=None if backend is None else getattr(backend, "name", str(backend)))


class QKNormMixin:
    """Turns a built vLLM DeepSeek model into its QK-normed form when its config records a norm."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        norm = servable_norm(vllm_config.model_config.hf_config, **_settings(vllm_config))  # before anything is built
        if not norm:  # a record without a norm or logit scale (a GQA conversion's): vLLM's layers
            super().__init__(vllm_config=vllm_config, prefix=prefix)
        else:
            platform = current_platform.device_type
            # the backend vLLM's registry holds under qkmla's name for this platform (registry.py)
            backend, decode_backend = registered_backend(BACKEND_NAMES[platform]), BACKENDS[platform][1]
            # vLLM's DeepSeek attention builds its MLA layer as qkmla's (a pipeline stage only its own layers)
            with qk_normed_mla_layers(norm, backend, decode_backend):
                super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.qk_norm_record = norm

    def _qk_layers(self) -> list[QKNormLatentAttention]:
        return [m for m in self.modules() if isinstance(m, QKNormLatentAttention)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        norm = self.qk_norm_record
        variant = None
        if norm is not None and norm.kind is not None:
            variant = norm.name

        def renamed():
            for name, tensor in weights:
                if any(part in name for part in _NORM_TENSORS):
                    if not norm:
                        raise ValueError(f"{name}: this checkpoint has QK-norm weights but config.json has no "
                                         f"{RECORD!r} record; save it with qkmla (apply_latent_attention(..., "
                                         f"qk_norm=...), save_pretrained) so the record says which norm they belong to")
                    if name.endswith("._extra_state"):
                        saved = bytes(tensor.tolist()).decode("ascii", "replace")
                        if saved != variant:
                            raise ValueError(f"{name}: says these weights belong to a {saved} QK norm, but "
                                             f"config.json's {RECORD!r} record says {variant}")
                        continue
                    name = name.replace(".self_attn.", ".self_attn.mla_attn.", 1)
                yield name, tensor

        loaded = super().load_weights(renamed())
        # Called directly on a served model (vLLM runs no hook after that), the attention layers'
        # derived weights are refreshed here, as vLLM's in-place reload refreshes them; while vLLM
        # loads (first load, reload_weights) the layers are not processed yet, and vLLM processes them next.
        for layer in self._qk_layers():
            if layer.mla_attn.processed():
                layer.mla_attn.process_weights_after_loading(layer.mla_attn.act_dtype)
        return loaded


class QKNormDeepseekV2ForCausalLM(QKNormMixin, DeepseekV2ForCausalLM):
    pass


class QKNormDeepseekV3ForCausalLM(QKNormMixin, DeepseekV3ForCausalLM):
    pass
