"""A small decoder-only LM whose attention is chosen by name (nanoGPT-sized, pre-norm, RoPE).

    tokens -> embedding -> [RMSNorm -> attention -> + ; RMSNorm -> MLP -> +] x n_layer
           -> RMSNorm -> lm_head (tied to the embedding by default)

No biases anywhere; positions come from RoPE inside attention. The attention variants:

    mha, gqa, mqa                       MultiHeadAttention, no QK norm
    mha-qknorm, gqa-qknorm              ... with per-head QK RMSNorm (Qwen3 placement)
    mha-l2, gqa-l2, mha-lp, gqa-lp      ... with L2 / Lp QK norm (learnable logit scale)
    mla                                 plain MLA
    mla-qknorm                          MLA, blockwise QK RMSNorm (the paper's method)
    mla-qknorm-unified                  MLA, unified QK RMSNorm (ablation)
    mla-l2, mla-lp                      MLA with L2 / Lp QK norm (learnable logit scale)
    v4                                  DeepSeek-V4's shared-KV MQA: one key = value vector per
                                        token, weighted RMSNorm on it, unweighted per-head RMSNorm
                                        on the query, partial RoPE, attention sinks

``init_seed`` draws every random tensor from a generator of its own, seeded by the seed and the
tensor's name, so two variants with that seed share every tensor they both have (the embedding,
the MLPs), whatever their attention draws; None keeps one stream for the whole model, in order.
"""

from __future__ import annotations

import dataclasses
import math
import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ..attention.mha import MultiHeadAttention
from ..attention.mla import MLA
from ..attention.shared_kv import SharedKVAttention
from ..cache.full import FullKVCache
from ..cache.latent import LatentCache
from ..cache.shared_kv import SharedKVCache
from ..config import (AttentionConfig, MLAConfig, QKNormConfig, SharedKVConfig, check_positive_int,
                      check_softmax_scale, fixed_config)
from ..kv_formats import check_kv_format
from ..rope import exact_positions
from ..utils.checked import check_bool, is_finite_number, is_int, is_number, python_numbers
from ..utils.limits import check_fits

LOGIT_SCALE_PARAMS = ("linear", "log")
ATTENTION_VARIANTS = (
    "mha", "gqa", "mqa", "mha-qknorm", "gqa-qknorm", "mha-l2", "gqa-l2", "mha-lp", "gqa-lp",
    "mla", "mla-qknorm", "mla-qknorm-unified", "mla-l2", "mla-lp", "v4",
)
INIT_SEED_MAX = 2 ** 31 - 1
QK_NORM_P = 3.0  # GPTConfig.qk_norm_p's default, the one value a variant that does not read it takes
# The shape fields only some variants read (None: the variant's default), see fields_read_by
UNSHARED_FIELDS = ("n_kv_head", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "shared_kv_dim", "attention_sinks")


def fields_read_by(attn: str, shared_kv_dim: Optional[int]) -> tuple:
    """The :data:`UNSHARED_FIELDS` the variant ``attn`` reads: MLA's its groups and ranks, v4 its ranks, D and
    sinks (kv_lora_rank only for the default D = d_c + d_r), gqa its groups, mha and mqa none."""
    if attn.startswith("mla"):
        return ("n_kv_head", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")
    if attn == "v4":
        return ("q_lora_rank", "qk_rope_head_dim", "shared_kv_dim", "attention_sinks") + \
            (("kv_lora_rank",) if shared_kv_dim is None else ())
    return ("n_kv_head",) if attn.startswith("gqa") else ()


@dataclass(frozen=True)
class GPTConfig:
    """Model shape and the attention variant.

    MLA dims by default follow DeepSeek's proportions at this width: with head_dim =
    n_embd / n_head, d_r = head_dim / 3 (even), d_n = head_dim - d_r, d_v = head_dim,
    d_c = 2 x head_dim, and a direct q_proj (``q_lora_rank`` None) unless set.

    ``v4``: D = ``shared_kv_dim``, by default d_c + d_r at this shape (plain MLA's cache row, so
    the two cache as many values per token), RoPE on its last d_r, ``q_lora_rank`` as for MLA,
    sinks unless ``attention_sinks`` is False.
    """

    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    attn: str = "mla-qknorm"
    n_kv_head: Optional[int] = None  # GQA groups (default n_head // 2 for gqa, n_head for MLA)
    qk_norm_p: float = QK_NORM_P  # p of the "-lp" variants
    kv_lora_rank: Optional[int] = None  # MLA d_c (default 2 x head_dim)
    q_lora_rank: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    mlp_ratio: float = 4.0
    tie_embeddings: bool = True
    dropout: float = 0.0
    rope_theta: float = 10000.0
    # None: the variant's default (learned for l2/lp, fixed otherwise). True on an RMS
    # QK-norm variant lifts the temperature cap of unit norm weights (Henry et al.).
    learnable_logit_scale: Optional[bool] = None
    softmax_scale: Optional[float] = None  # tau (initial value when learned); None: the variant's default
    # How a learned logit scale is trained: "linear" (the parameter is the scale) or "log"
    # (the parameter is its log: an optimizer step changes the scale by a fraction of itself,
    # so a temperature moves as far from 1 as from 20).
    logit_scale_param: str = "linear"
    shared_kv_dim: Optional[int] = None  # v4: D (default d_c + d_r, plain MLA's cache row)
    attention_sinks: Optional[bool] = None  # v4: None means True (V4 has them)
    init_seed: Optional[int] = None  # per-tensor random init (see the module docstring)

    def __post_init__(self) -> None:
        python_numbers(self)  # np.int64(2) is the int 2 (utils.checked)
        if self.attn not in ATTENTION_VARIANTS:
            raise ValueError(f"attn: expected one of {ATTENTION_VARIANTS}, got {self.attn!r}")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_positive_int(name, getattr(self, name))  # also below 2**63: block_size=2**70 was accepted
        # Positions 0..block_size-1 are rotated by float32 RoPE angles (the model's dtype, or bf16/fp16 computed in
        # float32), which hold integers exactly up to 2**24 only (rope.exact_positions): block_size=2**24 + 2 was
        # taken, and a full window was refused only at its forward, naming positions, after the work before it.
        longest = exact_positions(torch.float32) + 1
        if self.block_size > longest:
            raise ValueError(f"block_size: expected at most {longest} (2**24 + 1: positions 0..block_size-1 must be "
                             f"exact in the float32 RoPE angles), got {self.block_size}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head: must divide n_embd={self.n_embd}, got {self.n_head}")
        # None means the variant's default; 0 must not quietly mean it too (attention_config's `or`),
        # and a negative width would be refused later under the derived field's name (head_dim).
        for name in ("n_kv_head", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "shared_kv_dim"):
            check_positive_int(name, getattr(self, name), allow_none=True)
        if not is_number(self.dropout) or \
                not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: expected a number in [0, 1), got {self.dropout!r}")
        ratio = self.mlp_ratio
        if not is_finite_number(ratio) or \
                int(ratio * self.n_embd) < 1:
            raise ValueError(f"mlp_ratio: expected a finite number with mlp_ratio x n_embd >= 1 (the MLP's width; "
                             f"n_embd={self.n_embd}), got {ratio!r}")
        try:  # the norm's own check of p, whatever the variant: refused even where only -lp reads it
            QKNormConfig("lp", p=self.qk_norm_p)
        except ValueError as e:
            raise ValueError(f"qk_norm_{e}") from None
        # Only the -lp variants read p: qk_norm_p=5 on attn="mla" built plain MLA without a word. Its default is
        # taken everywhere (a saved config of any variant holds it), another value only where it is read.
        if self.qk_norm_p != QK_NORM_P and not self.attn.endswith("-lp"):
            raise ValueError(f"qk_norm_p: only the -lp variants read it, got qk_norm_p={self.qk_norm_p!r} with "
                             f"attn={self.attn!r}; leave it at its default ({QK_NORM_P})")
        # A switch given as a string ("no") is truthy: tie_embeddings="no" tied the head to the embedding, and
        # attention_sinks="no" (v4, where only False turns them off) kept the sinks, without a word.
        check_bool("tie_embeddings", self.tie_embeddings)
        for name in ("learnable_logit_scale", "attention_sinks"):
            if getattr(self, name) is not None:
                try:
                    check_bool(name, getattr(self, name))
                except ValueError as e:
                    raise ValueError(f"{e} (or None: the variant's default)") from None
        if self.logit_scale_param not in LOGIT_SCALE_PARAMS:
            raise ValueError(f"logit_scale_param: expected one of {LOGIT_SCALE_PARAMS}, got {self.logit_scale_param!r}")
        if self.init_seed is not None and (not is_int(self.init_seed)
                                           or not 0 <= self.init_seed <= INIT_SEED_MAX):
            raise ValueError(f"init_seed: expected None or an int in [0, {INIT_SEED_MAX}], got {self.init_seed!r}")
        # softmax_scale=0 was taken as None (the variant's default, through attention_config's `or`), without a word
        check_softmax_scale(self.softmax_scale)
        # A field the variant never reads was kept without a word (kv_lora_rank=8 on gqa built a GQA model of the
        # same shape as without it): refused, naming it and the variants that read it
        for name in UNSHARED_FIELDS:
            if getattr(self, name) is not None and name not in fields_read_by(self.attn, self.shared_kv_dim):
                if self.attn == "v4":  # kv_lora_rank, beside shared_kv_dim
                    raise ValueError(f"{name}: v4 reads it only for its default shared_kv_dim (d_c + d_r), and "
                                     f"shared_kv_dim={self.shared_kv_dim} is set; leave it None")
                families = [f for f in ("gqa", "mla", "v4") if name in fields_read_by(f, None)]
                who = " and ".join(families) + (" variants read" if len(families) > 1 else " variant reads")
                raise ValueError(f"{name}: only the {who} it, got attn={self.attn!r}; leave it None")
        self._check_shapes()
        if self.attn == "v4" and self.learnable_logit_scale:
            raise ValueError("learnable_logit_scale: the v4 variant has a fixed logit scale (as DeepSeek-V4); "
                             "leave it None or False")
        cfg = self.attention_config()  # validates the derived attention config
        if self.logit_scale_param == "log" and not cfg.learnable_logit_scale:
            raise ValueError(f"logit_scale_param: 'log' needs a learned logit scale, which attn={self.attn!r} does not "
                             "have; set learnable_logit_scale=True or use an -l2/-lp variant")

    def _check_shapes(self) -> None:
        """The derived attention shapes, refused under the names of this config's fields: the attention configs
        named their own (n_kv_head=3 as "num_kv_groups", an odd n_embd / n_head as "head_dim", v4's
        qk_rope_head_dim as "rope_head_dim"), which a GPTConfig does not have."""
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            allowed = [g for g in range(1, self.n_head + 1) if self.n_head % g == 0]
            raise ValueError(f"n_kv_head: must divide n_head={self.n_head} (allowed: {allowed}), got {self.n_kv_head}")
        if self.qk_rope_head_dim is not None and self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim: RoPE rotates pairs, so it must be even, got {self.qk_rope_head_dim}")
        if not self.is_mla and self.attn != "v4" and self.head_dim % 2:
            raise ValueError(f"n_head: each head's width n_embd / n_head is rotated by RoPE in pairs, so it must be "
                             f"even; got n_embd={self.n_embd} / n_head={self.n_head} = {self.head_dim}")
        if self.attn == "v4" and self.shared_kv_dim is not None and self.shared_kv_dim < self._mla_rope_dim():
            raise ValueError(f"shared_kv_dim: RoPE rotates the last qk_rope_head_dim={self._mla_rope_dim()} dims of "
                             f"the shared vector, so at least that, got {self.shared_kv_dim}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def is_mla(self) -> bool:
        return self.attn.startswith("mla")

    def _mla_rope_dim(self) -> int:
        return self.qk_rope_head_dim or max(2, (self.head_dim // 3) // 2 * 2)

    def attention_config(self):
        """The :class:`MLAConfig`, :class:`AttentionConfig` or :class:`SharedKVConfig` of every layer."""
        if self.attn == "v4":
            d_r = self._mla_rope_dim()
            return SharedKVConfig(
                hidden_size=self.n_embd, num_heads=self.n_head,
                head_dim=self.shared_kv_dim or (self.kv_lora_rank or 2 * self.head_dim) + d_r, rope_head_dim=d_r,
                q_lora_rank=self.q_lora_rank, attention_sinks=self.attention_sinks is not False,
                rope_theta=self.rope_theta, softmax_scale=self.softmax_scale)
        kind, _, norm = self.attn.partition("-")
        norm_kind = {"": None, "qknorm": "rms", "qknorm-unified": "rms", "l2": "l2", "lp": "lp"}[norm]
        # Unit-L2/Lp vectors have small dot products: learn the logit scale (Henry et al.),
        # starting where an RMS-normalized head of the same width would be.
        unit_vectors = norm_kind in ("l2", "lp")
        learnable = unit_vectors if self.learnable_logit_scale is None else self.learnable_logit_scale
        qk_norm = QKNormConfig(norm_kind, "unified" if norm == "qknorm-unified" else "blockwise",
                               self.qk_norm_p if norm_kind == "lp" else 2.0, learnable_logit_scale=learnable)
        if kind == "mla":
            d_r = self._mla_rope_dim()
            d_n = self.head_dim - d_r if self.head_dim - d_r > 0 else self.head_dim
            init = self.softmax_scale if self.softmax_scale is not None else \
                (math.sqrt(d_n + d_r) if unit_vectors else None)
            return MLAConfig(
                hidden_size=self.n_embd, num_heads=self.n_head, num_kv_groups=self.n_kv_head or self.n_head,
                q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank or 2 * self.head_dim,
                qk_nope_head_dim=d_n, qk_rope_head_dim=d_r, v_head_dim=self.head_dim, rope_theta=self.rope_theta,
                qk_norm=qk_norm, softmax_scale=init,
            )
        kv = {"mha": self.n_head, "mqa": 1, "gqa": self.n_kv_head or max(1, self.n_head // 2)}[kind]
        init = self.softmax_scale if self.softmax_scale is not None else \
            (math.sqrt(self.head_dim) if unit_vectors else None)
        return AttentionConfig(
            hidden_size=self.n_embd, num_heads=self.n_head, num_kv_heads=kv, head_dim=self.head_dim,
            rope_theta=self.rope_theta, qk_norm=qk_norm, softmax_scale=init,
        )

    def replace(self, **changes) -> "GPTConfig":
        """The config with ``changes``. Another ``attn`` drops the fields of this one's shape that the new variant
        does not read (a preset's MLA ranks under attn='gqa', an -lp variant's qk_norm_p), unless ``changes`` sets
        them."""
        if changes.get("attn", self.attn) != self.attn and changes["attn"] in ATTENTION_VARIANTS:
            reads = fields_read_by(changes["attn"], changes.get("shared_kv_dim", self.shared_kv_dim))
            changes = {**{n: None for n in UNSHARED_FIELDS if n not in reads}, **changes}
            if not changes["attn"].endswith("-lp"):  # p too: only the -lp variants read it
                changes = {"qk_norm_p": QK_NORM_P, **changes}
        return dataclasses.replace(self, **changes)


# From seconds on a CPU (debug) to the seed paper's 400M shape (it only has to build and step).
GPT_PRESETS: dict[str, GPTConfig] = {
    "debug": GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64),
    "cpu": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=128),  # nanoGPT's CPU config
    "shakespeare": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384, dropout=0.2),  # nanoGPT's GPU config
    "paper-400m": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=16, n_embd=1536,
                            q_lora_rank=768, kv_lora_rank=256, qk_rope_head_dim=32),
}


class MLP(nn.Module):
    def __init__(self, n_embd: int, ratio: float, dropout: float):
        super().__init__()
        hidden = int(ratio * n_embd)
        self.up = nn.Linear(n_embd, hidden, bias=False)
        self.down = nn.Linear(hidden, n_embd, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        attn_cfg = config.attention_config()
        self.ln_1 = nn.RMSNorm(config.n_embd)
        kind = {MLAConfig: MLA, AttentionConfig: MultiHeadAttention, SharedKVConfig: SharedKVAttention}
        self.attn = kind[type(attn_cfg)](attn_cfg)
        self.ln_2 = nn.RMSNorm(config.n_embd)
        self.mlp = MLP(config.n_embd, config.mlp_ratio, config.dropout)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, cache=None, **kw):
        x = x + self.dropout(self.attn(self.ln_1(x), cache, **kw))
        return x + self.mlp(self.ln_2(x))


class LogParametrization(nn.Module):
    """value = exp(theta): a positive parameter trained in log space
    (``torch.nn.utils.parametrize``; the stored tensor is theta = log value)."""

    def forward(self, theta: torch.Tensor) -> torch.Tensor:
        return theta.exp()

    def right_inverse(self, value: torch.Tensor) -> torch.Tensor:
        return value.log()


def check_targets(targets, idx: torch.Tensor, vocab_size: int) -> None:
    """A ValueError naming ``targets`` unless it is integer token ids of idx's shape, each in [0, vocab_size) or
    -1 (ignored), and not all -1 (the mean over no token is NaN): checked before the loss, where torch's
    cross_entropy failed with "Target 40 is out of bounds" (an IndexError), "expected target dtype to be Long" or
    "Expected input batch_size (16) to match target batch_size (14)", naming no argument of this model."""
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.long, torch.int32) \
            or targets.shape != idx.shape:
        got = f"{targets.dtype} {tuple(targets.shape)}" if isinstance(targets, torch.Tensor) else f"{targets!r:.80}"
        raise ValueError(f"targets: expected integer token ids of idx's shape {tuple(idx.shape)} (-1: no loss "
                         f"there), got {got}")
    if targets.device != idx.device:
        raise ValueError(f"targets: idx is on {idx.device} and targets on {targets.device}; pass "
                         f"targets.to({str(idx.device)!r})")
    if not torch.compiler.is_compiling() and targets.numel() and not targets.is_meta:  # meta: shapes only (forward)
        lo, hi = int(targets.min()), int(targets.max())
        if lo < -1 or hi >= vocab_size:
            raise ValueError(f"targets: token ids must lie in [0, vocab_size={vocab_size}) or be -1 (no loss "
                             f"there), got {lo}..{hi}")
        if hi == -1:  # the mean over no token: cross_entropy's NaN, without a word
            raise ValueError(f"targets: every target is -1 (no loss there), so there is no loss to average over "
                             f"{targets.numel()} positions; give at least one token id, or targets=None for the "
                             f"logits alone")


class GPT(nn.Module):
    """Decoder-only LM. ``forward(idx [B, T], targets=None, caches=None) -> (logits [B, T, V], loss)``."""

    config = fixed_config()

    def __init__(self, config: GPTConfig):
        super().__init__()
        d, hidden = config.n_embd, int(config.mlp_ratio * config.n_embd)
        # A lower bound of the float32 weights (embedding, attention output, MLP), before any is made.
        check_fits("config", 4 * (config.vocab_size * d + config.n_layer * (d * d + 2 * d * hidden)),
                   f"the weights of a GPT with vocab_size={config.vocab_size}, n_embd={d}, n_layer={config.n_layer}")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.RMSNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("o_proj.weight", "down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        if config.init_seed is not None:
            self._draw_per_tensor(config.init_seed)
        if config.logit_scale_param == "log":
            for block in self.blocks:
                parametrize.register_parametrization(block.attn, "logit_scale", LogParametrization())

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @torch.no_grad()
    def _draw_per_tensor(self, init_seed: int) -> None:
        """Redraw every random weight (the Linear and Embedding weights, at the std they were given)
        from a generator seeded by ``init_seed`` and the tensor's name; constants (norm gains,
        sinks) stay. A tensor two variants share by name and shape is then the same in both."""
        residual = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():  # a tied lm_head is the embedding, listed once
            if not name.endswith("weight") or not isinstance(self.get_submodule(name.rpartition(".")[0]),
                                                            (nn.Linear, nn.Embedding)):
                continue
            std = residual if name.endswith(("o_proj.weight", "down.weight")) else 0.02
            # The CPU generator keeps 32 bits of its seed: one 32-bit hash of both
            digest = hashlib.blake2b(f"{init_seed}/{name}".encode(), digest_size=4).digest()
            g = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little"))
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(std).to(p.dtype))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def make_caches(self, batch_size: int, capacity: int, policy=None, kv_format: str = "dense", **kwargs) -> list:
        """One cache per layer: a :class:`LatentCache` for MLA variants, a :class:`SharedKVCache` for v4,
        a :class:`FullKVCache` otherwise.

        ``policy``: an eviction policy (``qkmla.cache.eviction``) every layer's latent cache runs
        on its own tokens and scores; ``kv_format``: how the latent caches store their latents
        (``qkmla.kv_formats.KV_FORMATS``). Both MLA variants only."""
        check_kv_format(kv_format, self.wte.weight.device)
        if policy is not None and not self.config.is_mla:
            raise ValueError(f"policy: eviction runs on latent caches, so on MLA variants only; "
                             f"attn={self.config.attn!r}")
        if kv_format != "dense" and not self.config.is_mla:
            raise ValueError(f"kv_format: {kv_format!r} stores latents, so MLA variants only; attn={self.config.attn!r}")
        if "device" in kwargs:  # was passed on beside the model's own: "got multiple values for argument 'device'"
            raise ValueError(f"device: the caches are made on the model's device ({self.wte.weight.device}); move "
                             f"the model (model.to(device)) and leave device out")
        caches = []
        dtype = kwargs.pop("dtype", None) or self.wte.weight.dtype
        if policy is not None:
            kwargs["policy"] = policy
        if kv_format != "dense":  # only latent caches take it, and then every layer's is one
            kwargs["kv_format"] = kv_format
        for block in self.blocks:
            cfg = block.attn.config
            cls = {MLAConfig: LatentCache, SharedKVConfig: SharedKVCache}.get(type(cfg), FullKVCache)
            caches.append(cls.from_config(cfg, batch_size, capacity, dtype=dtype, device=self.wte.weight.device, **kwargs))
        return caches

    def _check_cached_reach(self, caches, T: int, input_lengths) -> None:
        """A ValueError naming idx if T new tokens (input_lengths[b] real ones, when given as a [B] tensor) after
        the cached ones reach past block_size: without a cache such a sequence is refused unless allow_longer,
        but through caches the model rotated positions it never saw in training without a word (a prefill of 20
        tokens at block_size=8). Not read while compiling, nor on the meta device (shapes only)."""
        positions = getattr(caches[0], "next_positions", None)
        if not isinstance(positions, torch.Tensor) or positions.is_meta or torch.compiler.is_compiling():
            return
        real = input_lengths if isinstance(input_lengths, torch.Tensor) and input_lengths.shape == positions.shape \
            else T
        reach = int((positions + (real.to(positions.device) if isinstance(real, torch.Tensor) else real)).max())
        if reach > self.config.block_size:
            raise ValueError(f"idx: {T} new tokens after the cached ones reach position {reach - 1}, past "
                             f"block_size={self.config.block_size} (positions 0..{self.config.block_size - 1}); "
                             f"pass allow_longer=True to evaluate past the positions the model was trained on")

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, caches: Optional[list] = None,
                input_lengths: Optional[torch.Tensor] = None, allow_longer: bool = False):
        """``allow_longer`` evaluates sequences past ``block_size`` (length extrapolation: RoPE
        has no table to run out of, but the model never saw those positions in training)."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.long, torch.int32):
            got = f"{idx.dtype} {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else f"{idx!r:.80}"
            raise ValueError(f"idx: expected integer token ids of shape [batch, seq], got {got}")
        # ids on a device other than the embedding's failed reading their range ("Tensor.item() cannot be called on
        # meta tensors") or in the embedding ("Expected all tensors to be on the same device")
        where = self.wte.weight.device
        if idx.device.type != where.type or None not in (idx.device.index, where.index) \
                and idx.device.index != where.index:
            raise ValueError(f"idx: the model is on {where} and idx on {idx.device}; pass idx.to({str(where)!r})")
        check_bool("allow_longer", allow_longer)  # "no" is truthy: a sequence past block_size was evaluated
        B, T = idx.shape
        if T == 0:  # refused deep in the first layer, as its argument x, which the caller never passed
            raise ValueError(f"idx: expected at least one token per sequence, got shape {tuple(idx.shape)}")
        # An id past the vocabulary is an index error deep in the embedding (a device assert
        # on a GPU); checked here, outside a compiled graph (where the read would break it).
        # Not on the meta device, whose tensors hold shapes only: a shape-only forward of a model built under
        # torch.device("meta") (to count its activations, say) failed here with "Tensor.item() cannot be called
        # on meta tensors", naming nothing.
        if not torch.compiler.is_compiling() and idx.numel() and not idx.is_meta and \
                (int(idx.min()) < 0 or int(idx.max()) >= self.config.vocab_size):
            raise ValueError(f"idx: token ids must lie in [0, vocab_size={self.config.vocab_size}), got "
                             f"{int(idx.min())}..{int(idx.max())}")
        if caches is None and T > self.config.block_size and not allow_longer:
            raise ValueError(f"idx: sequence of {T} tokens is longer than block_size={self.config.block_size}")
        # One cache per layer, before any layer writes: a list of one for a 2-layer model wrote layer 0's cache,
        # then failed with IndexError ("list index out of range"); a longer list had its extra caches ignored.
        if caches is not None and (not isinstance(caches, (list, tuple)) or len(caches) != len(self.blocks)):
            got = f"{len(caches)} caches" if isinstance(caches, (list, tuple)) else f"{type(caches).__name__}"
            raise ValueError(f"caches: expected a list of one cache per layer ({len(self.blocks)}, as "
                             f"model.make_caches(batch_size, capacity) makes), got {got}")
        if caches is not None and not allow_longer:
            self._check_cached_reach(caches, T, input_lengths)
        x = self.drop(self.wte(idx))
        kw = {} if input_lengths is None else {"input_lengths": input_lengths}
        for i, block in enumerate(self.blocks):
            x = block(x, caches[i] if caches is not None else None, **kw)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            check_targets(targets, idx, self.config.vocab_size)
            # int32 ids are ids, as for idx: cross_entropy takes int64 alone
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten().long(), ignore_index=-1)
        return logits, loss
