"""vLLM plugin: serve QK-normed MLA checkpoints (what ``qkmla`` writes) through the latent cache.

Installed with ``pip install 'qkmla[vllm]'``; vLLM finds it through the ``vllm.general_plugins``
entry point ``qkmla = qkmla.integrations.vllm:register``, so

    vllm serve DIR                      # DIR: a checkpoint saved with a "qkmla" record
    vllm.LLM(DIR)

run the model with its QK norm. What the plugin adds (the math is qkmla's own, ``attention.absorbed``):

* ``model.py``: the DeepSeek-V2/V3 model classes, registered under vLLM's names. A checkpoint
  without a QK-norm record runs exactly as vLLM's own class; one with a record gets, in each
  layer, qkmla's norms and the attention below. The checks come first (``checks.py``).
* ``attention.py``: the layer: projections as vLLM's MLA wrapper, then qkmla's norms (both norm
  weights folded into the query, ``latent_query``'s fold), the key scalars r = sigma(c W_UK)
  from the new tokens' latents (``key_scalars``), RoPE on 2-D tensors, and vLLM's
  ``MLAAttention`` over a cache row widened by G scalars: [c | k_rope | r].
* ``backend.py``: the attention backend: decode through ``qkmla.ops.mla_decode.mla_decode_with_kvcache``
  on strided views of vLLM's paged cache, prefill through vLLM's own with the keys scaled by r.

Nothing here imports vLLM at module level: ``import qkmla`` never needs it.
"""

from __future__ import annotations

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM's DeepSeek-V2/V3 architecture names now
    resolve to qkmla's subclasses (the same model for a checkpoint without a QK-norm record)."""
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, f"qkmla.integrations.vllm.model:QKNorm{arch}")


__all__ = ["ARCHITECTURES", "register"]
