"""qkmla's architectures in vLLM: vLLM's DeepSeek-V2/V3 model classes, serving a checkpoint's recorded QK norm.

Registered under qkmla's own architecture names (``registry.py``): ``QKNormDeepseekV3ForCausalLM``
and ``QKNormDeepseekV2ForCausalLM``, which a QK-normed checkpoint declares (and which a checkpoint
qkmla wrote before it declared them is given, from its ``"qkmla"`` record). vLLM's own DeepSeek
classes serve every other DeepSeek checkpoint. Each attention layer is replaced by
:class:`~qkmla.integrations.vllm.attention.QKNormLatentAttention` after vLLM built it (a record
without a norm or logit scale, a GQA conversion's, leaves vLLM's layers). The checkpoint's norm
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
from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from vllm.model_executor.models.utils import PPMissingLayer
from vllm.platforms import current_platform

from ..hub.record import RECORD
from .attention import QKNormLatentAttention
from .backend import BACKENDS
from .checks import servable_norm

_NORM_TENSORS = (".self_attn.q_norm.", ".self_attn.k_norm.", ".self_attn.logit_scale")


def _settings(vllm_config) -> dict:
    c = vllm_config
    graphs = c.compilation_config.cudagraph_mode
    return dict(platform=current_platform.device_type, kv_cache_dtype=c.cache_config.cache_dtype,
                quantization=c.model_config.quantization,
                chunked_prefill=bool(c.scheduler_config.enable_chunked_prefill),
                prefix_caching=bool(c.cache_config.enable_prefix_caching),
                decode_context_parallel_size=c.parallel_config.decode_context_parallel_size,
                dtype=str(c.model_config.dtype).removeprefix("torch."), speculative=c.speculative_config is not None,
                lora=c.lora_config is not None, cuda_graphs=graphs is not None and graphs.name != "NONE")


class QKNormMixin:
    """Turns a built vLLM DeepSeek model into its QK-normed form when its config records a norm."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        norm = servable_norm(vllm_config.model_config.hf_config, **_settings(vllm_config))  # before anything is built
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.qk_norm_record = norm
        if not norm:
            return
        make_backend, decode_backend = BACKENDS[current_platform.device_type]
        for layer in self.model.layers:
            if not isinstance(layer, PPMissingLayer):
                attn = layer.self_attn
                attn.mla_attn = QKNormLatentAttention(attn, norm, make_backend(), decode_backend)

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
