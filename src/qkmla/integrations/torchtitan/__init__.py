"""torchtitan: pretrain QK-normed (or QK-clipped) DeepSeek-V3-style MLA, and carry the checkpoint out.

Installed with ``pip install 'qkmla[torchtitan]'`` (torchtitan>=0.3.0,<0.4, Python >= 3.11). Nothing
of torchtitan's is forked or patched: qkmla's layers enter through torchtitan's override mechanism
(``--override.imports``), and each module checks the torchtitan version before importing it.

* ``overrides.py``: ``qk_norm``, ``qk_clip`` + ``qk_clip_optimizer``, ``max_logits``,
  ``max_logit_metrics``: the door for torchtitan users.
* ``attention.py``: :class:`QKAttention`, torchtitan's DeepSeek-V3 ``Attention`` with qkmla's
  QK norm (qkmla's own norm modules) between the up-projections and RoPE, or QK-Clip's max logits.
* ``clip.py``: QK-Clip after each optimizer step (qkmla's MLA-aware row factors).
* ``metrics.py``: each layer's max attention logit in torchtitan's metrics.
* ``inner.py``: :class:`DenseMaskAttention`, an inner attention with a CPU backward (FlexAttention
  has none), for CPU runs and tests.
* ``checkpoint.py``: ``export_hf`` (a torchtitan model as a Hugging Face DeepSeek-V3 checkpoint
  with qkmla's record, which ``qkmla.integrations.transformers.from_pretrained`` loads and the vLLM
  plugin serves) and ``import_hf`` (a plain or QK-normed HF checkpoint into torchtitan).

``import qkmla`` never imports torchtitan; import the modules above by name.
"""
