"""Conversions of whole models: a QK norm added to a DeepSeek-architecture model and calibrated, and
a QK-normed GQA model (Qwen3, OLMoE) converted to MLA. Each works on a model in memory and on a
checkpoint directory (``qkmla convert`` and ``qkmla convert-gqa`` run the latter).

    warm_start_qk_norm(model, ids)             convert_checkpoint(src, out, qk_norm="rms")
    convert_gqa(model)                         convert_gqa_checkpoint(src, out)

They load and save models with transformers (``pip install "qkmla[hf]"``), imported when they run.
"""

from .calibrate import warm_start_qk_norm
from .gqa import convert_gqa, convert_gqa_checkpoint
from .qk_norm import convert_checkpoint

__all__ = ["convert_checkpoint", "convert_gqa", "convert_gqa_checkpoint", "warm_start_qk_norm"]
