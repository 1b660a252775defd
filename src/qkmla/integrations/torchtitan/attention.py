"""torchtitan's DeepSeek-V3 MLA with qkmla's post-up-projection QK norm, QK-Clip's max logits, or
neither: one subclass of torchtitan's ``Attention`` that its overrides put in place.

The layer is torchtitan's own (the same projections, latent norms, RoPE, inner attention and
parameter names); what it adds sits between the up-projections and RoPE, as in qkmla's
:class:`~qkmla.MLA` (MATH.md, "QK-normalized MLA"):

    q = [q^C | q^R] = W_Q x                    [B, T, h, d_n + d_r]
    k^C = W_UK c,  k^R = W_KR x                [B, T, h, d_n], [B, T, 1, d_r]
    q^C, q^R <- q_head_norm(q^C, q^R)         qkmla's QKNorm: RMS blockwise (the paper's),
    k^C, k^R <- k_head_norm(k^C, k^R)         unified or content; L2; Lp
    q^R, k^R <- RoPE(q^R), RoPE(k^R)
    logits = tau_h q . k                       tau: torchtitan's softmax scale, or a learned one per head

Its parameters say what they are: ``q_head_norm.{content,rope}.weight`` and
``k_head_norm.{content,rope}.weight`` (torchtitan's ``q_norm`` / ``kv_norm`` are the latent
norms), ``logit_scale`` [h] when the scale is learned. A checkpoint exported to Hugging Face
(``checkpoint.export_hf``) names them as qkmla's transformers integration does.

With ``track_max_logits`` (or a QK-Clip threshold) each forward in training also measures every
head's largest pre-softmax logit over the logits attention uses (causal, within each packed
document), an extra Q K^T in chunks without gradients: QK-Clip (``clip.py``) and the max-logit
metric (``metrics.py``) read it.

Shapes: B sequences, T tokens, h heads (the local heads under tensor parallelism).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from .versions import check_torchtitan

check_torchtitan()

import spmd_types as spmd  # noqa: E402  (torchtitan's dependency)
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.models.deepseek_v3.model import Attention  # noqa: E402
from torchtitan.models.common.decoder_sharding import dense_param_placement  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402
from torchtitan.protocols.sharding import ShardingConfig  # noqa: E402

from ...attention.functional import max_logits  # noqa: E402
from ...config import QKNormConfig  # noqa: E402
from ...norms import QKNorm, ScalarNorm, make_qk_norms  # noqa: E402
from ...utils.checked import check_bool, is_finite_number  # noqa: E402


def document_mask(positions: Optional[torch.Tensor]):
    """Which logits attention uses beyond causality, as a FlexAttention-style ``mask_mod`` of
    (batch, head, query, key) indices: within one packed document, documents starting where
    ``positions`` [B, T] restarts at 0 (torchtitan's block-causal convention). None: causal only."""
    if positions is None:
        return None
    document = torch.cumsum((positions == 0).to(torch.int32), dim=-1)  # [B or 1, T]

    def same_document(b, h, q_idx, kv_idx):
        rows = document if document.shape[0] > 1 else document.expand(b.shape[0], -1)
        return rows[b, q_idx] == rows[b, kv_idx]

    return same_document


class TitanScalarNorm(ScalarNorm, Module):
    """qkmla's :class:`~qkmla.norms.ScalarNorm` (its math, unchanged) as a torchtitan ``Module``: its
    Trainer refuses a model with plain ``nn.Module`` s in it (``verify_module_protocol``) and
    initializes each ``Module``'s own weights (ones here) after building on the meta device. In a
    parallelized layer its weight is declared replicated over tensor parallelism, as torchtitan
    declares the latent norms' (:class:`QKAttention`): with scope "head" it is the same for every
    head, so the heads a tensor-parallel rank holds use it as it is."""

    def _init_self_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(1.0)


class TitanQKNorm(QKNorm, Module):
    """qkmla's :class:`~qkmla.norms.QKNorm` as a torchtitan ``Module`` (see :class:`TitanScalarNorm`)."""

    scalar_norm = TitanScalarNorm


class MaxLogitMeter(Module):
    """Each head's running max logit [h] (-inf: nothing measured), a buffer updated in place
    (torchtitan's CUDA graphs replay kernels, not Python assignments). Not saved in checkpoints. A
    torchtitan ``Module`` without a sharding config: ``parallelize`` leaves it on each rank."""

    def __init__(self, heads: int):
        super().__init__()
        self.register_buffer("running", torch.full((heads,), -math.inf), persistent=False)

    def _init_self_buffers(self, *, buffer_device=None) -> None:
        with torch.no_grad():
            self.running.fill_(-math.inf)


class QKAttention(Attention):
    """torchtitan's DeepSeek-V3 ``Attention`` with qkmla's QK norm, or with QK-Clip, or plain with
    its max logits measured (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Attention.Config):
        qk_norm: Optional[QKNormConfig] = None
        # tau_0 of a learned logit scale; None: torchtitan's softmax scale for RMS, sqrt(d_n + d_r)
        # for L2/Lp (unit vectors: the logit an RMS-normalized head of the same width would give).
        logit_scale_init: Optional[float] = None
        qk_clip_tau: Optional[float] = None  # QK-Clip's threshold; the clip itself runs after the optimizer step
        track_max_logits: bool = False

        def __post_init__(self) -> None:
            Attention.Config.__post_init__(self)  # slots=True: no zero-argument super()
            norm = QKNormConfig.of(self.qk_norm, "qk_norm")
            object.__setattr__(self, "qk_norm", norm)
            if self.qk_clip_tau is not None:
                if not is_finite_number(self.qk_clip_tau) or self.qk_clip_tau <= 0:
                    raise ValueError(f"qk_clip_tau: expected a finite positive threshold, got {self.qk_clip_tau!r}")
                if norm is not None:
                    raise ValueError(f"qk_clip_tau: QK-Clip and a QK norm ({norm.name}) cannot be combined: the norm "
                                     "would undo the clip's rescaling; activate one of the two overrides")
            check_bool("track_max_logits", self.track_max_logits)
            if self.logit_scale_init is not None:
                if norm is None or not norm.learnable_logit_scale:
                    raise ValueError("logit_scale_init: only read with a learned logit scale "
                                     "(qk_norm with learnable_logit_scale=True)")
                if not is_finite_number(self.logit_scale_init) or self.logit_scale_init <= 0:
                    raise ValueError(f"logit_scale_init: expected a finite positive number, got "
                                     f"{self.logit_scale_init!r}")

    def __init__(self, config: Config):
        super().__init__(config)
        norm = config.qk_norm
        self.qk_norm_config = norm
        self.q_head_norm, self.k_head_norm = make_qk_norms(
            norm, config.qk_nope_head_dim, config.qk_rope_head_dim, config.n_heads, config.n_heads, TitanQKNorm)
        if config.sharding_config is not None and norm is not None:  # set by torchtitan's update_from_config
            replicated = ShardingConfig(state_shardings={"weight": dense_param_placement(tp=spmd.R)})
            for qk in (self.q_head_norm, self.k_head_norm):
                qk.content._sharding_config = qk.rope._sharding_config = replicated
        self.logit_scale = None
        if norm is not None and norm.learnable_logit_scale:
            unit = norm.kind in ("l2", "lp")
            self.logit_scale_init = config.logit_scale_init or (math.sqrt(self.qk_head_dim) if unit
                                                                else self.softmax_scale)
            self.logit_scale = nn.Parameter(torch.full((config.n_heads,), float(self.logit_scale_init)))
        # what tensor parallelism cannot split by heads: the projection scope pools its statistic over every head
        self.per_head_weights = "q_head_norm, k_head_norm weights (scope 'projection')" \
            if norm is not None and norm.scope == "projection" else ""

        self.qk_clip_tau = config.qk_clip_tau
        self.track_max_logits = config.track_max_logits or config.qk_clip_tau is not None
        self.max_logit_meter = MaxLogitMeter(config.n_heads)
        self.step_max_logits: Optional[torch.Tensor] = None  # [h] of the last closed step
        self.clipped_max_logits: Optional[torch.Tensor] = None  # [h] after the last clip: min(S_h, tau)

    def _distribute_states(self, parallel_dims) -> None:
        """torchtitan's ``parallelize`` distributes a ``Module``'s own parameters by its sharding config,
        which names only torchtitan's: the learned logit scale [h] is declared split over tensor
        parallelism by heads, as the query projection's rows are, so each rank holds its heads' scales.
        Context parallelism is refused for a layer that measures its max logits: each rank would hold
        its shard of the queries and keys, not the logits attention uses."""
        if self.track_max_logits and getattr(parallel_dims, "cp_enabled", False):
            raise ValueError(f"parallelism.context_parallel_degree: {parallel_dims.cp} splits the sequence over ranks, "
                             "and QK-Clip and the max-logit metric measure the logits of whole sequences; use "
                             "context_parallel_degree=1 with qkmla's qk_clip, max_logits or track_max_logits (the QK "
                             "norm itself is per token and runs under context parallelism)")
        config = self._sharding_config
        if self.logit_scale is not None and config is not None and "logit_scale" not in config.state_shardings:
            self._sharding_config = dataclasses.replace(config, state_shardings={
                **config.state_shardings, "logit_scale": dense_param_placement(tp=spmd.S(0))})
        super()._distribute_states(parallel_dims)

    @property
    def running_max_logits(self) -> torch.Tensor:
        """[h] on this rank since the step was last closed, -inf where nothing was measured."""
        return self.max_logit_meter.running

    def _init_self_parameters(self) -> None:
        """torchtitan builds on the meta device and initializes each ``Module``'s own parameters: the
        norms set theirs (ones); the learned logit scale is set here."""
        with torch.no_grad():
            if self.logit_scale is not None:
                self.logit_scale.fill_(float(self.logit_scale_init))

    def forward(self, x: torch.Tensor, attention_masks, positions: Optional[torch.Tensor] = None):
        """x [B, T, dim] -> [B, T, dim]; ``attention_masks`` and ``positions`` as torchtitan passes them."""
        bsz, seqlen, _ = x.size()
        if self.q_lora_rank == 0:
            q = self.wq(x)
        else:
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        with spmd.local():
            q = q.view(bsz, seqlen, -1, self.qk_head_dim)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv = self.wkv_a(x)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(2)
        kv = self.wkv_b(self.kv_norm(kv))
        with spmd.local():
            kv = kv.view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
            k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        if q.shape[2] != self.n_heads and self.per_head_weights:
            raise ValueError(f"parallelism.tensor_parallel_degree: this layer has {q.shape[2]} of its {self.n_heads} "
                             f"heads on this rank, and its {self.per_head_weights} pool one statistic over every "
                             "head, which qkmla does not compute across ranks yet; use a QK norm with scope='head', "
                             "or tensor_parallel_degree=1")
        if self.q_head_norm is not None:  # before RoPE, as qkmla's MLA (the cache stores normalized rows)
            q_nope, q_pe = self.q_head_norm(q_nope, q_pe)
            k_nope, k_pe = self.k_head_norm(k_nope, k_pe)  # unified/content: k_pe takes each head's scalar
        q_pe, k_pe = self.rope(q_pe, k_pe, positions)
        scale = self.softmax_scale
        with spmd.local():
            q = torch.cat([q_nope, q_pe], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.size(2), -1)], dim=-1)
            if self.logit_scale is not None:  # per head: folded into q, the inner attention takes one scale
                q, scale = q * self.logit_scale.to(q.dtype)[:, None], 1.0
        if self.track_max_logits and self.training:
            self._track(q, k, scale, positions)
        output = self.inner_attention(q, k, v, attention_masks=attention_masks, scale=scale).contiguous()
        return self.wo(output.view(bsz, seqlen, -1))

    def _head_offset(self, local_heads: int) -> int:
        """The first of this rank's heads: 0, or under tensor parallelism the rank's place on torchtitan's
        "tp" mesh times its head count (the query projection's rows are split by heads, in order)."""
        if local_heads == self.n_heads:
            return 0
        weight = (self.wq if self.q_lora_rank == 0 else self.wq_b).weight
        names = weight.device_mesh.mesh_dim_names if isinstance(weight, DTensor) else None
        if not names or "tp" not in names:
            raise ValueError(f"parallelism: this rank holds {local_heads} of this layer's {self.n_heads} heads, split "
                             "in a way other than torchtitan's tensor parallelism; QK-Clip and the max-logit metric "
                             "need to know which heads they are")
        return weight.device_mesh.get_local_rank("tp") * local_heads

    def _track(self, q: torch.Tensor, k: torch.Tensor, scale: float, positions: Optional[torch.Tensor]) -> None:
        """This rank's heads' max logits into their slots of the running maxima [h] (the others stay -inf
        here; the step's close takes the max over every rank)."""
        # this rank's rows: under torchtitan's full_dtensor backend the batch (positions included) arrives as
        # DTensors sharded over the data-parallel ranks
        q, k, positions = (t.to_local() if isinstance(t, DTensor) else t for t in (q, k, positions))
        first = self._head_offset(q.shape[2])
        with torch.autocast(q.device.type, enabled=False):  # the statistic in float32, not autocast's bf16
            step = max_logits(q.detach().float(), k.detach().float(), scale, allowed=document_mask(positions))
        mine = self.running_max_logits[first:first + q.shape[2]]
        torch.maximum(mine, step.to(mine.dtype), out=mine)


def qk_attention_layers(model_parts) -> list[tuple[str, QKAttention]]:
    """(name, layer) of every :class:`QKAttention` in torchtitan's model parts (a module or a list)."""
    parts = model_parts if isinstance(model_parts, (list, tuple)) else [model_parts]
    return [(name, module) for part in parts for name, module in part.named_modules()
            if isinstance(module, QKAttention)]


def _layer_slot(name: str) -> tuple[int, int]:
    """(table, row) of a layer named ``...layers.{i}.attention`` (table 0) or
    ``...mtp_layers.{i}.attention`` (table 1)."""
    parts = name.split(".")
    i = max(k for k, part in enumerate(parts) if part in ("layers", "mtp_layers"))
    return int(parts[i] == "mtp_layers"), int(parts[i + 1])


def close_steps(model_parts) -> dict[str, torch.Tensor]:
    """Close the step of every measuring :class:`QKAttention`: {name: per-head max logits [h]} over
    every rank (one MAX all-reduce of a [layers, h] table when torch.distributed is initialized, so
    data-parallel ranks and pipeline stages each holding other layers all get the global figure),
    kept as each layer's ``step_max_logits``; the running maxima restart (-inf). A layer that
    measured nothing on any rank is left out. A non-finite figure (an overflowed logit) is kept as it
    is, for the caller to see (QK-Clip refuses to clip with it).

    Every rank must call it at the same steps (the trainer's optimizer hook and metrics logging do)
    and hold at least one measuring layer. Context parallelism is not supported: each rank would
    measure its own shard's queries against its own keys."""
    layers = [(name, layer) for name, layer in qk_attention_layers(model_parts) if layer.track_max_logits]
    if not layers:
        return {}
    heads = layers[0][1].n_heads
    device = layers[0][1].running_max_logits.device  # NCCL reduces device tensors only
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    slots = {name: _layer_slot(name) for name, _ in layers}
    rows = torch.tensor([max((r for (t, r) in slots.values() if t == table), default=-1) + 1 for table in (0, 1)],
                        device=device)
    if distributed:
        torch.distributed.all_reduce(rows, op=torch.distributed.ReduceOp.MAX)
    offset = int(rows[0])
    table = torch.full((int(rows.sum()), heads), -math.inf, dtype=torch.float32, device=device)
    for name, layer in layers:
        t, r = slots[name]
        table[t * offset + r] = layer.running_max_logits
    if distributed:
        torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX)
    closed = {}
    for name, layer in layers:
        t, r = slots[name]
        row = table[t * offset + r]
        layer.running_max_logits.fill_(-math.inf)
        if not bool((row == -math.inf).all()):
            layer.step_max_logits = closed[name] = row
    return closed
