"""qkmla: QK normalization for Multi-head Latent Attention without full-key caching."""

# Before anything imports torch: a junk OMP_NUM_THREADS on qkmla's command line is reported in
# qkmla's one line, not by OpenMP, which reads it as torch loads (utils/environment.py).
from .utils.environment import drop_bad_thread_counts_for_command_line

drop_bad_thread_counts_for_command_line()

from .attention import MLA, MultiHeadAttention
from .cache import ContiguousLayout, FullKVCache, LatentCache, PagedLayout
from .config import MLA_PRESETS, AttentionConfig, MLAConfig, QKNormConfig, mla_preset
from .norms import QKNorm, ScalarNorm

__version__ = "0.1.0"

__all__ = [
    "MLA", "MLA_PRESETS", "AttentionConfig", "ContiguousLayout", "FullKVCache", "LatentCache", "MLAConfig",
    "MultiHeadAttention", "PagedLayout", "QKNorm", "QKNormConfig", "ScalarNorm", "mla_preset",
]
