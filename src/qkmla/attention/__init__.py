"""Attention layers: MLA (explicit, absorbed, expand paths), the MHA/GQA/MQA baselines, DeepSeek-V4's
shared key=value attention (``shared_kv``) and the top-k selection of cached rows for sparse decode
(``selection``)."""

from .mha import MultiHeadAttention
from .absorbed import AbsorbedWeights
from .mla import MLA

__all__ = ["MLA", "AbsorbedWeights", "MultiHeadAttention"]
