"""qkmla's Triton decode kernel launched for vLLM's CUDA backend as CUDA graphs need it.

``qkmla.ops.mla_decode.mla_decode_with_kvcache`` picks its launch on each call: its split count
from the block table's width (for vLLM, the longest sequence the model takes, whatever the
batch holds), its partial-output buffers allocated on each call, and a launch configuration
that does not fit retried with the next. Under a CUDA graph each of these is fixed at capture.
:class:`TritonDecode` launches the same two kernels (split, then combine; ``triton_kernel.py``)
with everything chosen from host integers before the launch:

* the split count from the batch's longest sequence (``attn_metadata.max_seq_len``, which vLLM
  keeps on the host) and the batch size (:func:`decode_splits`), never from a device tensor;
* the partial outputs (o_part [B, 1, h, splits, d_c], lse_part [B, 1, h, splits], float32) in
  vLLM's workspace (``vllm.v1.worker.workspace``), reserved when the layer is built for the
  largest batch and sequence vLLM will run (:func:`workspace_rows`): the workspace exists before
  the model is loaded, so vLLM's memory profile counts it, and vLLM locks it before it captures
  graphs, so a decode that asked for more would fail loudly instead of growing it;
* the launch configuration (``LAUNCH_CONFIGS``) settled at the first launch, which vLLM runs
  eagerly (its profile and warm-up runs) before any capture: one that does not fit the GPU's
  shared memory moves on to the next there, and never during a capture.

vLLM's own TRITON_MLA does the same for its kernel (``_compute_num_kv_splits`` from
``max_seq_len``, ``_reserve_attn_logits_workspace``). Not yet run on a GPU: on the CPU the
kernels run in Triton's interpreter, and the launch is checked under fake tensors
(``tests/integrations/vllm/test_cuda_decode.py``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

MAX_SPLITS = 64  # as qkmla's own default_num_splits


def decode_splits(batch: int, head_blocks: int, max_seq_len: int, block_n: int, sms: int) -> int:
    """Splits of each sequence's keys for a decode of ``batch`` queries, the longest over
    ``max_seq_len`` keys: enough programs for about two waves over ``sms`` multiprocessors, at most
    one split per key tile of the longest sequence and :data:`MAX_SPLITS`, rounded down to a power
    of two (the count is a kernel constant: each one compiles a kernel of its own)."""
    tiles = max(1, math.ceil(max_seq_len / block_n))
    want = max(1, min(tiles, math.ceil(2 * sms / max(1, batch * head_blocks)), MAX_SPLITS))
    return 1 << (want.bit_length() - 1)


def workspace_rows(max_batch: int, head_blocks: int, max_seq_len: int, block_n: int, sms: int) -> int:
    """The most (query, split) pairs any decode of up to ``max_batch`` queries over up to
    ``max_seq_len`` keys launches: max over B of B x :func:`decode_splits` (fewer splits as B
    grows, so this stays near max(max_batch, 2 sms))."""
    return max(b * decode_splits(b, head_blocks, max_seq_len, block_n, sms) for b in range(1, max_batch + 1))


class TritonDecode:
    """One layer's decode through qkmla's Triton kernel: q_lat [B, h, d_c], q_rope [B, h, d_r] over
    vLLM's paged rows -> out [B, h, d_c] (q_lat's dtype). See the module's docstring."""

    def __init__(self, num_heads: int, kv_lora_rank: int, *, max_batch: int, max_seq_len: int, sms: int,
                 reserve: bool = True):
        from ...ops.mla_decode import triton_kernel

        self.num_heads, self.kv_lora_rank, self.sms = num_heads, kv_lora_rank, sms
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.kernels = triton_kernel
        self.index = 0  # into LAUNCH_CONFIGS: the first that fits, settled at the first (eager) launch
        if reserve:
            self.reserve()

    def launch(self, batch: int, max_seq_len: int) -> dict:
        """The split kernel's launch (``triton_kernel.launch_config``) for ``batch`` queries, the
        longest sequence ``max_seq_len`` keys: host integers in, host integers out."""
        k = self.kernels
        first = k.launch_config(self.num_heads, batch, max_seq_len, None, self.index, num_splits=1)
        splits = decode_splits(batch, first["head_blocks"], max_seq_len, first["BLOCK_N"], self.sms)
        return {**first, "num_splits": splits}

    def most_rows(self) -> int:
        """(query, split) pairs to reserve: the most any launch configuration asks for."""
        rows = 0
        for index in range(len(self.kernels.LAUNCH_CONFIGS)):
            launch = self.kernels.launch_config(self.num_heads, 1, 1, None, index, num_splits=1)
            rows = max(rows, workspace_rows(self.max_batch, launch["head_blocks"], self.max_seq_len,
                                            launch["BLOCK_N"], self.sms))
        return rows

    def reserve(self) -> None:
        """Grow vLLM's workspace to the largest partial outputs any decode will ask for (where vLLM
        has set its workspace up: a worker's, not a unit test's)."""
        from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

        if is_workspace_manager_initialized():
            rows = self.most_rows() * self.num_heads
            current_workspace_manager().get_simultaneous(((rows, self.kv_lora_rank), torch.float32),
                                                         ((rows,), torch.float32))

    def buffers(self, batch: int, splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """o_part [B, 1, h, splits, d_c] and lse_part [B, 1, h, splits], float32: views of vLLM's
        workspace, or fresh tensors where there is none."""
        from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized

        shapes = (((batch, 1, self.num_heads, splits, self.kv_lora_rank), torch.float32),
                  ((batch, 1, self.num_heads, splits), torch.float32))
        if is_workspace_manager_initialized():
            o_part, lse_part = current_workspace_manager().get_simultaneous(*shapes)
            return o_part, lse_part
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes)

    def __call__(self, q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                 scale_cache: Optional[torch.Tensor], block_table: torch.Tensor, seq_lens: torch.Tensor,
                 max_seq_len: int, softmax_scale: float, unified: bool) -> torch.Tensor:
        """q_lat [B, h, d_c], q_rope [B, h, d_r], kv_cache [blocks, page, >= d_c + d_r] rows
        [c | k_rope] (a view), scale_cache [blocks, page, G] or None, block_table [B, blocks],
        seq_lens [B] -> [B, h, d_c]. ``max_seq_len``: max(seq_lens), known on the host."""
        from ...ops.mla_decode.backends import interpreting

        k = self.kernels
        B, H, d_c = q_lat.shape
        # the kernel's dots take both operands in the cache's dtype
        q, r = (t.to(kv_cache.dtype).unsqueeze(1).contiguous() for t in (q_lat, q_rope))
        while True:
            launch = self.launch(B, max_seq_len)
            splits = launch["num_splits"]
            o_part, lse_part = self.buffers(B, splits, q.device)
            args, options = k.split_kernel_args(q, r, kv_cache, scale_cache, block_table, seq_lens, softmax_scale,
                                                o_part, lse_part, launch, unified, None, interpreting(), "dense")
            try:
                k._mla_decode_split_kernel[(B, launch["head_blocks"], splits)](*args, **options)
                break
            except Exception as error:  # Triton's OutOfResources: this configuration's tiles do not fit
                if type(error).__name__ != "OutOfResources" or self.index + 1 == len(k.LAUNCH_CONFIGS):
                    raise
                if q.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError("qkmla's Triton decode: its launch configuration did not fit while vLLM "
                                       "captured a CUDA graph; it is settled at the first eager launch (vLLM's "
                                       "profile and warm-up runs), which did not run first") from error
                self.index += 1
        out = torch.empty(B, 1, H, d_c, dtype=q.dtype, device=q.device)
        lse = torch.empty(B, 1, H, dtype=torch.float32, device=q.device)
        k._mla_decode_combine_kernel[(B, H)](
            o_part, lse_part, out, lse,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
            lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1),
            S_Q=1, D_C=d_c, NUM_SPLITS=splits, SPLITS_P2=k.triton.next_power_of_2(splits),
        )
        return out[:, 0].to(q_lat.dtype)
