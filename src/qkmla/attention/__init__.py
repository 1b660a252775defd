"""Attention layers: MLA (explicit, absorbed, expand paths) and MHA/GQA/MQA baselines."""

from .mha import MultiHeadAttention
from .mla import MLA, AbsorbedWeights

__all__ = ["MLA", "AbsorbedWeights", "MultiHeadAttention"]
