"""torchtitan: pretrain QK-normed (or QK-clipped) DeepSeek-V3-style MLA, and carry the checkpoint out.

Installed with ``pip install 'qkmla[torchtitan]'`` (torchtitan>=0.3.0,<0.4, Python >= 3.11). Nothing
of torchtitan's is forked or patched: qkmla's layers enter through torchtitan's override mechanism
(``--override.imports``), and each module checks the torchtitan version before importing it.

* ``overrides.py``: ``qk_norm``, ``qk_clip`` + ``qk_clip_optimizer``, ``max_logits``,
  ``max_logit_metrics``: the door for torchtitan users.
* ``config_registry.py``: qkmla's own configs (``--module qkmla.integrations.torchtitan --config
  qkmla_cpu_qk_norm``, ...): qkmla's flavors on the embedded Shakespeare, plain / QK norm / QK-Clip.
* ``data.py``: the byte tokenizer and local text loader those configs train with.
* ``flavors.py``: DeepSeek-V3-shaped model configs that export (``cpu``, ``h200``).
* ``attention.py``: :class:`QKAttention`, torchtitan's DeepSeek-V3 ``Attention`` with qkmla's
  QK norm (qkmla's own norm modules) between the up-projections and RoPE, or QK-Clip's max logits.
* ``clip.py``: QK-Clip after each optimizer step (qkmla's MLA-aware row factors).
* ``metrics.py``: each layer's max attention logit in torchtitan's metrics.
* ``inner.py``: :class:`DenseMaskAttention`, an inner attention with a CPU backward (FlexAttention
  has none), for CPU runs and tests.
* ``checkpoint.py``: ``export_hf`` (a torchtitan model as a Hugging Face DeepSeek-V3 checkpoint
  with qkmla's record, which ``qkmla.integrations.transformers.from_pretrained`` loads and the vLLM
  plugin serves) and ``import_hf`` (a plain or QK-normed HF checkpoint into torchtitan).
* ``export.py``: ``python -m qkmla.integrations.torchtitan.export STEP_DIR OUT -- <the run's arguments>``,
  a run's DCP checkpoint as a Hugging Face checkpoint.

``import qkmla`` never imports torchtitan; import the modules above by name.
"""
