"""Attention layers: MLA (explicit, absorbed, expand paths) and MHA/GQA/MQA baselines."""

from .mha import MultiHeadAttention
from .absorbed import AbsorbedWeights
from .mla import MLA

__all__ = ["MLA", "AbsorbedWeights", "MultiHeadAttention"]
