"""MHA / GQA / MQA baselines with optional per-head QK norm (Qwen3 / OLMo 2 placement).

q = x W_Q, k = x W_K, v = x W_V split into heads; with ``qk_norm`` each head's q and k go
through one :class:`~qkmla.norms.ScalarNorm` (weights shared across heads) after the
projection and before RoPE, as in Qwen3. Decoding caches the normalized, rotated keys and
the values in a :class:`~qkmla.cache.FullKVCache`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..cache.full import FullKVCache
from ..config import AttentionConfig, fixed_config
from ..norms import HeadNorm
from ..rope import RotaryEmbedding
from ..utils.limits import check_weights
from .functional import check_forward, default_positions, TracksMaxLogits, record_max_logits, sdpa, zero_padding


class MultiHeadAttention(TracksMaxLogits):
    """MHA (num_kv_heads = num_heads), GQA (between) or MQA (num_kv_heads = 1).

    Examples:
        >>> import torch
        >>> from qkmla import AttentionConfig, FullKVCache, MultiHeadAttention
        >>> cfg = AttentionConfig(num_heads=4, num_kv_heads=2, qk_norm="rms")
        >>> attn = MultiHeadAttention(cfg)
        >>> y = attn(torch.randn(1, 5, cfg.hidden_size))  # [1, 5, 64]
    """

    config = fixed_config()

    def __init__(self, config: AttentionConfig):
        super().__init__()
        if not isinstance(config, AttentionConfig):
            raise ValueError(f"config: expected an AttentionConfig, got {type(config).__name__}")
        self.config = c = config
        d = c.dim_per_head
        check_weights("config", [(c.num_heads * d, c.hidden_size), (c.num_kv_heads * d, c.hidden_size)] * 2,
                      f"the projections of an attention layer with hidden_size={c.hidden_size}, "
                      f"num_heads={c.num_heads}, head_dim={d}")
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_heads * d, c.hidden_size, bias=False)
        if c.has_qk_norm:
            n = c.qk_norm
            self.q_norm, self.k_norm = HeadNorm(d, n.kind, n.p, n.eps), HeadNorm(d, n.kind, n.p, n.eps)
        else:
            self.q_norm = self.k_norm = None
        self.logit_scale = nn.Parameter(torch.full((c.num_heads,), c.scale)) if c.learnable_logit_scale else None
        self.rotary = RotaryEmbedding(d, c.rope_theta, c.rope_interleave)
        self.track_max_logits = False  # as in MLA: per-head max logit of each explicit forward
        self.last_max_logits: Optional[torch.Tensor] = None
        self.max_logit_seconds = 0.0

    @property
    def scale(self):
        return self.logit_scale if self.logit_scale is not None else self.config.scale

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """Normalized, rotated q [B, T, h, d], k [B, T, G, d] and v [B, T, G, d]."""
        c = self.config
        B, T = x.shape[:2]
        q = self.q_proj(x).view(B, T, c.num_heads, -1)
        k = self.k_proj(x).view(B, T, c.num_kv_heads, -1)
        v = self.v_proj(x).view(B, T, c.num_kv_heads, -1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary(q, positions), self.rotary(k, positions), v

    def forward(self, x: torch.Tensor, cache: Optional[FullKVCache] = None, *,
                positions: Optional[torch.Tensor] = None, input_lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, hidden_size] -> [B, T, hidden_size]; arguments as in :meth:`qkmla.MLA.forward`."""
        check_forward(self, x, cache, FullKVCache, input_lengths)
        if cache is None:
            q, k, v = self.qkv(x, default_positions(x, positions))
            if self.track_max_logits:
                record_max_logits(self, q, k)
            return self.o_proj(sdpa(q, k, v, self.scale, causal=True).flatten(2))
        slot = cache.plan(x.shape[0], x.shape[1], positions, input_lengths, writer=self)
        q, k, v = self.qkv(zero_padding(x, slot.valid), slot.positions)
        k, v = cache.update(slot, k, v)
        return self.o_proj(sdpa(q, k, v, self.scale, mask=slot.key_mask()).flatten(2))
