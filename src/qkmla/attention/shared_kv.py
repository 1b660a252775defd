"""Shared-KV attention, DeepSeek-V4's design: MQA whose one KV head is both key and value.

Per token (MATH.md, "Shared-KV attention (DeepSeek-V4)")::

    q   = W_UQ RMSNorm_w(W_DQ x)         [h, D]   (or W_Q x without a query LoRA)
    q_h = q_h / RMS(q_h)                           per head, no weight: QK-norm at no cost
    c   = RMSNorm_w(W_KV x)              [D]      the cache row, key and value at once
    RoPE on the last d_r dims of every q_h and of c (interleaved pairs, as V4)
    o_h = sum_s softmax_s(tau q_h . c_s ; sink_h) c_s
    o_h[-d_r:] rotated by minus the query's position   (the values carried RoPE: undo it, as V4)
    y   = W_O [o_1 ... o_h]

The reference is transformers' ``DeepseekV4Attention`` (models/deepseek_v4/modeling_deepseek_v4.py,
5.24) on its sliding-window layers: ``q_a_proj`` / ``q_a_norm`` / ``q_b_proj`` / ``q_b_norm``
(unweighted) / ``kv_proj`` / ``kv_norm`` / ``sinks``, partial RoPE on the trailing ``rope_head_dim``
of each head and the conjugate rotation of the output's RoPE slice. Left out: the compressed
(CSA/HCA) branches, the sliding window, and the grouped low-rank output projection, which is
there to save FLOPs at V4's width (h x D = 8 x hidden) and would not at this library's.

Decoding caches c after its norm and RoPE in a :class:`~qkmla.cache.shared_kv.SharedKVCache`:
D values per token and layer, nothing else.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..cache.shared_kv import SharedKVCache
from ..config import SharedKVConfig, fixed_config
from ..norms import LatentRMSNorm, rms_norm
from ..rope import RotaryEmbedding
from ..utils.limits import check_weights
from .functional import (TracksMaxLogits, check_forward, default_positions, record_max_logits, sdpa,
                         sink_attention, zero_padding)


class SharedKVAttention(TracksMaxLogits):
    """``forward(x [B, T, hidden_size], cache=None) -> [B, T, hidden_size]``.

    Examples:
        >>> import torch
        >>> from qkmla.attention.shared_kv import SharedKVAttention
        >>> from qkmla.config import SharedKVConfig
        >>> attn = SharedKVAttention(SharedKVConfig(hidden_size=64, num_heads=4, head_dim=32, rope_head_dim=8))
        >>> attn(torch.randn(1, 5, 64)).shape
        torch.Size([1, 5, 64])
    """

    config = fixed_config()

    def __init__(self, config: SharedKVConfig):
        super().__init__()
        if not isinstance(config, SharedKVConfig):
            raise ValueError(f"config: expected a SharedKVConfig, got {type(config).__name__}")
        self.config = c = config
        d, h, D = c.hidden_size, c.num_heads, c.head_dim
        # Sized against the machine before torch's allocator is asked, as MLA and MultiHeadAttention are:
        # hidden_size=2**30 failed in nn.Linear with "DefaultCPUAllocator: can't allocate memory", naming nothing.
        query = [(h * D, d)] if c.q_lora_rank is None else [(c.q_lora_rank, d), (h * D, c.q_lora_rank)]
        check_weights("config", query + [(D, d), (d, h * D)],
                      f"the projections of a shared-KV attention layer with hidden_size={d}, num_heads={h}, "
                      f"head_dim={D}, q_lora_rank={c.q_lora_rank}")
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * D, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=False)
            self.q_a_norm = LatentRMSNorm(c.q_lora_rank, eps=c.norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, h * D, bias=False)
        self.kv_proj = nn.Linear(d, D, bias=False)
        self.kv_norm = LatentRMSNorm(D, eps=c.norm_eps)
        self.o_proj = nn.Linear(h * D, d, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h)) if c.attention_sinks else None
        self.rotary = RotaryEmbedding(c.rope_head_dim, c.rope_theta, interleave=True)
        self.track_max_logits = False  # as in MLA: per-head max logit of each explicit forward
        self.last_max_logits: Optional[torch.Tensor] = None
        self.max_logit_seconds = 0.0

    @property
    def scale(self) -> float:
        return self.config.scale

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, H, D] with its last d_r dims rotated to ``positions`` [B, T]."""
        n = self.config.nope_head_dim
        return torch.cat((x[..., :n], self.rotary(x[..., n:], positions)), dim=-1)

    def query(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Normalized, rotated queries [B, T, h, D]."""
        c = self.config
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = rms_norm(q.unflatten(-1, (c.num_heads, c.head_dim)), eps=c.norm_eps)
        return self._rope(q, positions)

    def shared_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The cache rows [B, T, 1, D]: normalized, rotated, each token's key and value."""
        return self._rope(self.kv_norm(self.kv_proj(x)).unsqueeze(2), positions)

    def _attend(self, q, kv, positions, mask=None, causal=False) -> torch.Tensor:
        if self.sinks is None:
            o = sdpa(q, kv, kv, self.scale, mask=mask, causal=causal)
        else:
            o = sink_attention(q, kv, kv, self.scale, self.sinks, mask=mask, causal=causal)
        n = self.config.nope_head_dim  # the values' RoPE slice back to position 0, at the query's position
        o = torch.cat((o[..., :n], self.rotary.shift(o[..., n:], -positions)), dim=-1)
        return self.o_proj(o.flatten(2))

    def forward(self, x: torch.Tensor, cache: Optional[SharedKVCache] = None, *,
                positions: Optional[torch.Tensor] = None, input_lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, hidden_size] -> [B, T, hidden_size]; arguments as in :meth:`qkmla.MLA.forward`."""
        check_forward(self, x, cache, SharedKVCache, input_lengths)
        if cache is None:
            positions = default_positions(x, positions)
            q, kv = self.query(x, positions), self.shared_kv(x, positions)
            if self.track_max_logits:
                record_max_logits(self, q, kv)
            return self._attend(q, kv, positions, causal=True)
        slot = cache.plan(x.shape[0], x.shape[1], positions, input_lengths, writer=self)
        x = zero_padding(x, slot.valid)
        q = self.query(x, slot.positions)
        kv = cache.update(slot, self.shared_kv(x, slot.positions))
        return self._attend(q, kv, slot.positions, mask=slot.key_mask())
