"""vLLM plugin: serve QK-normed MLA checkpoints (what ``qkmla`` writes) through the latent cache.

Installed with ``pip install 'qkmla[vllm]'``; vLLM finds it through the ``vllm.general_plugins``
entry point ``qkmla = qkmla.integrations.vllm:register``, so

    vllm serve DIR                      # DIR: a QK-normed checkpoint saved by qkmla
    vllm.LLM(DIR)

run the model with its QK norm. A QK-normed checkpoint declares an architecture of its own,
``QKNormDeepseekV3ForCausalLM`` (model type ``qkmla_deepseek_v3``; and V2), which the plugin
registers; every other checkpoint is vLLM's own business. What the plugin adds (the math is
qkmla's own, ``attention.absorbed``):

* ``registry.py``: the architectures, qkmla's backends by name in vLLM's registries, qkmla's model types in transformers' ``AutoConfig`` (vLLM
  reads config.json through it), and how vLLM reads those model types (as DeepSeek's MLA);
* ``model.py``: the model classes, vLLM's DeepSeek-V2/V3 built with qkmla's MLA layer (vLLM's
  pluggable MLA layer, ``attention.qk_normed_mla_layers``). The checks come first (``checks.py``).
* ``attention.py``: the layer: projections as vLLM's MLA wrapper, then qkmla's norms (both norm
  weights folded into the query, ``latent_query``'s fold), the key scalars r = sigma(c W_UK)
  from the new tokens' latents (``key_scalars``), RoPE on 2-D tensors, and vLLM's
  ``MLAAttention`` over a cache row widened by G scalars: [c | k_rope | r].
* ``backend.py``: the attention backend: decode through ``qkmla.ops.mla_decode.mla_decode_with_kvcache``
  on strided views of vLLM's paged cache, prefill through vLLM's own with the keys scaled by r;
  ``cuda_decode.py``: on CUDA, qkmla's Triton kernel launched as CUDA graphs need it.

The plugin reaches into vLLM's internals (docs/serving.md lists them), so it states the vLLM
releases it supports (:data:`SUPPORTED_VLLM`) and refuses any other before touching them.

Nothing here imports vLLM at module level: ``import qkmla`` never needs it.
"""

from __future__ import annotations

from ..hub.record import QK_ARCHITECTURES
from .versions import NEWEST_VLLM, SUPPORTED_VLLM, check_vllm_version, require_vllm, supported_vllm_text  # noqa: F401

ARCHITECTURES = tuple(QK_ARCHITECTURES.values())  # what the plugin registers with vLLM


def register() -> None:
    """The ``vllm.general_plugins`` entry point, run by vLLM in each of its processes: the installed
    vLLM's version checked first, then qkmla's architectures and model types registered
    (``registry.py``). vLLM's own DeepSeek architectures are left as they are."""
    require_vllm()  # the version before anything reads vLLM's internals
    from .registry import register_all

    register_all()


__all__ = ["ARCHITECTURES", "NEWEST_VLLM", "SUPPORTED_VLLM", "check_vllm_version", "register", "require_vllm"]
