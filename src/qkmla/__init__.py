"""qkmla: QK normalization for Multi-head Latent Attention without full-key caching."""

# Before anything imports torch, on qkmla's command line only: a junk OMP_NUM_THREADS is reported in
# qkmla's one line, not by OpenMP, which reads it as torch loads, and a Ctrl-C or SIGTERM while torch
# loads prints one line, not a traceback or nothing (utils/environment.py, utils/startup.py).
from .utils.environment import prepare_command_line

prepare_command_line()

from .attention import MLA, MultiHeadAttention
from .cache import ContiguousLayout, FullKVCache, LatentCache, PagedLayout
from .config import MLA_PRESETS, AttentionConfig, MLAConfig, QKNormConfig, mla_preset
from .norms import QKNorm, ScalarNorm

__version__ = "0.1.0"

__all__ = [
    "MLA", "MLA_PRESETS", "AttentionConfig", "ContiguousLayout", "FullKVCache", "LatentCache", "MLAConfig",
    "MultiHeadAttention", "PagedLayout", "QKNorm", "QKNormConfig", "ScalarNorm", "mla_preset",
]
