"""qkmla: QK normalization for Multi-head Latent Attention without full-key caching."""

from .attention import MLA, MultiHeadAttention
from .cache import ContiguousLayout, FullKVCache, LatentCache, PagedLayout
from .config import MLA_PRESETS, AttentionConfig, MLAConfig, QKNormConfig, mla_preset
from .norms import QKNorm, ScalarNorm

__version__ = "0.1.0"

__all__ = [
    "MLA", "MLA_PRESETS", "AttentionConfig", "ContiguousLayout", "FullKVCache", "LatentCache", "MLAConfig",
    "MultiHeadAttention", "PagedLayout", "QKNorm", "QKNormConfig", "ScalarNorm", "mla_preset",
]
