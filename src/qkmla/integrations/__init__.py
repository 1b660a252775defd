"""qkmla inside other libraries, each a thin adapter over qkmla's own layer, cache and decode op.

* ``hub``: Hugging Face checkpoint directories (config.json and safetensors) read without
  transformers: a DeepSeek-V2/V3 config as an :class:`~qkmla.MLAConfig`, attention layers as
  :class:`~qkmla.MLA` modules, and the ``"qkmla"`` record a QK-normed checkpoint carries.
* ``transformers``: a whole transformers MLA model decoding through qkmla's latent cache
  (``apply_latent_attention``), QK-normed checkpoints loaded back (``from_pretrained``), LoRA.
* ``vllm``: the vLLM plugin.

Conversions of whole checkpoints (adding a QK norm, GQA to MLA) live in :mod:`qkmla.convert`.
"""
