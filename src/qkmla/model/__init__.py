"""A small decoder-only LM with any attention variant, and sampling through the caches."""

from .generate import generate, sample_next
from .gpt import ATTENTION_VARIANTS, GPT, GPT_PRESETS, GPTConfig

__all__ = ["ATTENTION_VARIANTS", "GPT", "GPTConfig", "GPT_PRESETS", "generate", "sample_next"]
