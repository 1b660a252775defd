"""The MLA decode op: argument checks, the backend that runs, and the ``torch.library`` custom op.

One op, four implementations of the same specification (``naive.py``); which runs is decided
once per call by ``backends.resolve_backend`` (the registry and the meaning of ``"auto"`` are in
``backends.py``):

* ``"naive"``: ``naive.py`` itself, a float32 loop (float64 for float64 queries). Slow; it is the reference.
* ``"torch"``: ``torch_impl.py``, dense latent attention in a few large GEMMs (any device).
  On the CPU its paged read keeps a chunk's buffers between calls (``workspace.py``: about
  4,096 keys' rows per thread, 4.8 MB at d_c 512, d_r 64 and 16 scalars in bfloat16, more when
  batch x block size exceeds 4,096 keys, up to 64 MiB a buffer; ``workspace.release()`` frees them).
* ``"cpu"``: ``cpu_kernel.py``, a fused C++ kernel over dense bfloat16 rows on CPUs with
  AVX-512 BF16, compiled on first use (a C++ compiler and ninja; 9 s on 2 cores here, then
  cached): each row read once from its block, the key scalars multiplied into each score tile.
* ``"triton"``: ``triton_kernel.py``, a fused split-K kernel over the paged cache (CUDA, or
  Triton's CPU interpreter when ``TRITON_INTERPRET=1``), registered as the custom op
  ``qkmla::mla_decode`` with a fake (meta) implementation, so it traces under
  ``torch.compile`` and can be captured in CUDA graphs. Its number of splits is a static
  argument, so a captured graph never syncs with the host.

Every backend reads every row format of ``qkmla.kv_formats`` (``kv_format``): "dense" rows
[c ; k_rope], or uint8 rows of a quantized latent with its scales and a bfloat16 RoPE key,
which ``naive`` dequantizes before attending, ``torch`` per chunk of keys and the kernel per
tile, in registers. The format is resolved to its row object once, here (or by the cache,
which hands the op its own), and handed down.

Every backend also takes a sparse (top-k) decode, ``indices`` [B, S_q, topk] with an optional
``topk_length`` [B] (FlashMLA's arguments; the rule is drawn in ``naive.py``): each query
reads only its selected rows and their key scalars, through the block table, in every row format.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ...kv_formats import DenseRows, check_kv_format, row_format
from ...utils.checked import INT64_MAX, as_int, as_number, is_finite_number, is_int
from ...utils.limits import check_allocation
from .backends import check_backend, interpreting, resolve_backend
from .cpu_kernel import cpu_mla_decode
from .naive import default_visible_lens, naive_mla_decode
from .selection import packed_selection
from .torch_impl import check_paged_reach, fold_head_scale, lse_dtype, torch_mla_decode

MODES = ("blockwise", "unified")


@torch.library.custom_op("qkmla::mla_decode", mutates_args=())
def _mla_decode_op(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                   scale_cache: Optional[torch.Tensor], block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   softmax_scale: float, num_splits: int, unified: bool = False,
                   visible_lens: Optional[torch.Tensor] = None,
                   kv_format: str = "dense", indices: Optional[torch.Tensor] = None,
                   topk_length: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    from .triton_kernel import mla_decode_fwd  # Triton is imported only when the kernel runs

    return mla_decode_fwd(q_lat, q_rope, kv_cache, scale_cache, block_table, cache_seqlens, softmax_scale, num_splits,
                          unified=unified, visible_lens=visible_lens, dot_fp32=interpreting(), kv_format=kv_format,
                          indices=indices, topk_length=topk_length)


@_mla_decode_op.register_fake
def _(q_lat, q_rope, kv_cache, scale_cache, block_table, cache_seqlens, softmax_scale, num_splits, unified=False,
      visible_lens=None, kv_format="dense", indices=None, topk_length=None):
    B, S_q, H, _ = q_lat.shape
    # Contiguous, as mla_decode_fwd allocates its outputs (empty_like would keep q_lat's strides).
    return q_lat.new_empty(q_lat.shape), q_lat.new_empty((B, S_q, H), dtype=torch.float32)


def _check_int(name: str, t, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != len(shape) or t.dtype not in (torch.int32, torch.int64) \
            or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name}: expected an int32/int64 tensor [{want}], got {got}")


def check_inputs(q_lat, q_rope, kv_cache, block_table, cache_seqlens, scale_cache, mode: str = "blockwise",
                 visible_lens=None, kv_format: Union[str, DenseRows] = "dense") -> DenseRows:
    """ValueErrors naming the argument, before anything reaches a backend; returns the row format."""
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("kv_cache", kv_cache), ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not isinstance(kv_format, DenseRows):  # whether the device stores float8 is the cache's check, made once
        check_kv_format(kv_format)
    if q_lat.dim() != 4 or q_rope.dim() != 4 or q_lat.shape[:3] != q_rope.shape[:3]:
        raise ValueError(f"q_lat, q_rope: expected [B, S_q, H, d_c] and [B, S_q, H, d_r], got "
                         f"{tuple(q_lat.shape)} and {tuple(q_rope.shape)}")
    if q_lat.dtype != q_rope.dtype:
        raise ValueError(f"q_lat, q_rope: expected one dtype, got {q_lat.dtype} and {q_rope.dtype}")
    if not q_lat.dtype.is_floating_point:  # int64 queries ran, and returned an int64 output of truncated values
        raise ValueError(f"q_lat, q_rope: expected floating-point queries (bfloat16, float16, float32, float64), "
                         f"got {q_lat.dtype}")
    B, S_q, H, d_c = q_lat.shape
    d_r = q_rope.shape[-1]
    # An empty latent failed in a quantized row's arithmetic (ZeroDivisionError); named here by the
    # queries that carry its width (row_format would name kv_lora_rank, which the op does not take).
    if isinstance(d_c, int) and d_c < 1:
        raise ValueError(f"q_lat: expected a latent width d_c >= 1 ([B, S_q, H, d_c]), got {tuple(q_lat.shape)}")
    rows = row_format(kv_format, d_c, d_r)
    width = f"the {rows.name} row's bytes" if rows.quantized else "d_c + d_r"
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != rows.width:
        raise ValueError(f"kv_cache: expected [num_blocks, block_size, {width} = {rows.width}] for d_c={d_c}, "
                         f"d_r={d_r} (or [B, capacity, {width}] without a block table), got {tuple(kv_cache.shape)}")
    if not rows.quantized and not kv_cache.dtype.is_floating_point:
        raise ValueError(f"kv_cache: kv_format='dense' rows are floating-point values, got {kv_cache.dtype}; "
                         f"pass the cache's own kv_format (LatentCache.decode_view() names it) for byte rows")
    if rows.quantized and kv_cache.dtype != torch.uint8:
        raise ValueError(f"kv_cache: kv_format={rows.name!r} rows are uint8 bytes, got {kv_cache.dtype}; "
                         f"pass kv_format='dense' for rows of values")
    if block_table is None:
        if kv_cache.shape[0] != B:
            raise ValueError(f"kv_cache: without a block_table, expected [B={B}, capacity, d_c + d_r], "
                             f"got {tuple(kv_cache.shape)}")
    else:
        _check_int("block_table", block_table, (B, None))
    _check_int("cache_seqlens", cache_seqlens, (B,))
    if scale_cache is not None:
        if not isinstance(scale_cache, torch.Tensor) or scale_cache.dim() != 3 \
                or scale_cache.shape[:2] != kv_cache.shape[:2] or H % scale_cache.shape[-1]:
            raise ValueError(f"scale_cache: expected [num_blocks, block_size, G] with G dividing H={H}, got "
                             f"{tuple(getattr(scale_cache, 'shape', ()))}")
        if not scale_cache.dtype.is_floating_point:  # key scalars are real numbers; ints were cast silently
            raise ValueError(f"scale_cache: expected floating-point key scalars, got {scale_cache.dtype}")
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if visible_lens is not None:
        _check_int("visible_lens", visible_lens, (B, S_q))
        # A negative count made the query see nothing: an all-zero output without a word. (Past
        # the sequence's length is capped, by the specification; read where reading is free.)
        if _host_readable(visible_lens) and visible_lens.numel() and int(visible_lens.min()) < 0:
            raise ValueError(f"visible_lens: expected slot counts >= 0, got {int(visible_lens.min())}")
    for name, t in (("q_rope", q_rope), ("kv_cache", kv_cache), ("block_table", block_table),
                    ("cache_seqlens", cache_seqlens), ("scale_cache", scale_cache), ("visible_lens", visible_lens)):
        if t is not None and t.device != q_lat.device:
            raise ValueError(f"{name}: expected a tensor on q_lat's device ({q_lat.device}), got {t.device}")
    if q_lat.device.type == "meta":
        # Every backend reads the lengths' values (how many slots, which mask); meta tensors hold shapes only,
        # and the call failed in torch with "Tensor.item() cannot be called on meta tensors", naming nothing.
        # (torch.compile traces the op with fake tensors, which carry their real device: not refused here.)
        raise ValueError("q_lat: the decode op reads the values of cache_seqlens, which tensors on the meta device "
                         "(shapes only, e.g. a model and cache built under torch.device('meta')) do not hold; "
                         "decode on the cpu or an accelerator")
    return rows


def check_indices(indices, topk_length, q_lat: torch.Tensor, visible_lens=None) -> None:
    """ValueErrors naming ``indices`` / ``topk_length`` for a sparse decode's selection that is not
    an int32/int64 tensor [B, S_q, topk >= 1] (and [B]) on q_lat's device, before any work.
    The indices' values are not read here (a device-to-host read per call): entries outside a
    sequence's filled slots select nothing (``naive.py``). A negative ``topk_length`` is refused
    where reading it is free (a CPU tensor, outside compilation)."""
    B, S_q = q_lat.shape[:2]
    if indices is None:
        if topk_length is not None:
            raise ValueError("topk_length: counts the entries of indices to read; it needs indices (got None)")
        return
    if not isinstance(indices, torch.Tensor) or indices.dtype not in (torch.int32, torch.int64) \
            or indices.dim() != 3 or tuple(indices.shape[:2]) != (B, S_q) or indices.shape[2] < 1:
        got = f"{indices.dtype} {tuple(indices.shape)}" if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"indices: expected an int32/int64 tensor [B={B}, S_q={S_q}, topk >= 1] of slot positions "
                         f"(each in [0, cache_seqlens[b]) to select it, -1 for none), got {got}")
    if indices.device != q_lat.device:
        raise ValueError(f"indices: expected a tensor on q_lat's device ({q_lat.device}), got {indices.device}")
    if visible_lens is not None:
        raise ValueError("indices, visible_lens: a sparse decode's indices say which slots each query sees; pass "
                         "one of them (visible_lens=None with indices)")
    if topk_length is not None:
        if not isinstance(topk_length, torch.Tensor) or topk_length.dtype not in (torch.int32, torch.int64) \
                or tuple(topk_length.shape) != (B,):
            got = f"{topk_length.dtype} {tuple(topk_length.shape)}" if isinstance(topk_length, torch.Tensor) \
                else type(topk_length).__name__
            raise ValueError(f"topk_length: expected an int32/int64 tensor [B={B}] of entry counts (the first "
                             f"topk_length[b] entries of indices[b] are read), got {got}")
        if topk_length.device != q_lat.device:
            raise ValueError(f"topk_length: expected a tensor on q_lat's device ({q_lat.device}), "
                             f"got {topk_length.device}")
        # A negative count read no entry (an all-zero output without a word); where reading the
        # values is free (as cache_seqlens' are), it is refused. Past topk reads all: the spec.
        if _host_readable(topk_length) and topk_length.numel() and int(topk_length.min()) < 0:
            raise ValueError(f"topk_length: expected entry counts >= 0, got {int(topk_length.min())}")


def clear_unreached_blocks(block_table: torch.Tensor, cache_seqlens: torch.Tensor, block_size: int) -> torch.Tensor:
    """block_table [B, max_blocks] with every id past its sequence's reach, the first
    ceil(cache_seqlens[b] / block_size) entries of row b, set to 0: vLLM and FlashMLA callers pad a
    table with -1 (or 0) past a shorter sequence's blocks, and no backend reads those entries for
    that sequence, but the torch backend gathers whole columns of the batch and the kernels are
    handed the table as it is. Block 0 is a valid id whose rows are masked like every slot past a
    length. The ids within reach are left as they are, for the backends' checks to refuse.
    One tensor op, no device-to-host read (it runs in a captured or compiled decode step too)."""
    reach = -(-cache_seqlens.long() // block_size)  # [B], ceil without floats
    past = torch.arange(block_table.shape[1], device=block_table.device) >= reach[:, None]
    return block_table.masked_fill(past, 0)


def _host_readable(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values costs no device-to-host copy and no graph break."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def check_softmax_scale(softmax_scale, H: int, device: Optional[torch.device] = None) -> None:
    """A ValueError naming ``softmax_scale`` unless it is a finite number or a floating tensor [H] (on
    ``device``, q_lat's; its values checked finite where reading them is free: a CPU tensor, outside compilation)."""
    if isinstance(softmax_scale, torch.Tensor):
        if softmax_scale.shape != (H,) or not softmax_scale.dtype.is_floating_point:
            raise ValueError(f"softmax_scale: expected a float or a floating-point tensor [H={H}], got "
                             f"{softmax_scale.dtype} {tuple(softmax_scale.shape)}")
        if device is not None and softmax_scale.device != device:  # failed folding it into the queries, naming none
            raise ValueError(f"softmax_scale: expected a tensor on q_lat's device ({device}), got "
                             f"{softmax_scale.device}")
        if _host_readable(softmax_scale) and not bool(torch.isfinite(softmax_scale).all()):
            raise ValueError(f"softmax_scale: expected finite logit scales, got {softmax_scale.tolist()}")
        return
    # A float is a logit scale tau > 0, as MLAConfig's softmax_scale is: 0 makes every visible slot
    # equally likely and a negative one inverts the softmax, answers no caller means. (A tensor
    # [H] is a learned per-head scale, which training may carry through 0; only finite is asked.)
    # Within float32's normal range, as MLAConfig's (config.SOFTMAX_SCALE_RANGE; not imported: config imports the
    # ops): 1e300 passed "finite > 0" and made the scores inf, the output NaN, and 1e-320 scaled them to 0 (every
    # visible slot equally likely), both without a word.
    if not is_finite_number(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected the logit scale (a finite float > 0, or a tensor [H]), e.g. "
                         f"MLAConfig.scale; got {softmax_scale!r}")
    low, high = 2.0 ** -126, float.fromhex("0x1.fffffep+127")
    if not low <= softmax_scale <= high:
        raise ValueError(f"softmax_scale: expected the logit scale (a finite float > 0, or a tensor [H]) within "
                         f"float32's normal range ({low!r} to {high!r}), as MLAConfig's; got {softmax_scale!r}")


def check_split_and_length(num_splits, max_seqlen, cache_seqlens: torch.Tensor,
                           capacity: Optional[int] = None) -> None:
    """ValueErrors naming ``num_splits`` (an int >= 0) and ``max_seqlen`` (None, or an int >= 0, at
    most the slots a sequence can hold (``capacity``: past it, 2**70 say, the refusal named
    cache_seqlens, whose lengths were fine) and, where reading the lengths is free, at least
    max(cache_seqlens): a shorter one would drop the slots past it without a word)."""
    # Below 2**63 as every other count here: 2**63 was taken by the torch and CPU backends, which ignore it
    if not is_int(num_splits) or num_splits < 0 or num_splits > INT64_MAX:
        raise ValueError(f"num_splits: expected an int >= 0 and below 2**63 (0 picks one that fills the GPU), got "
                         f"{num_splits!r}")
    if max_seqlen is None:
        return
    if not is_int(max_seqlen) or max_seqlen < 0:
        raise ValueError(f"max_seqlen: expected None or an int >= 0 (max(cache_seqlens)), got {max_seqlen!r}")
    if capacity is not None and max_seqlen > capacity:
        raise ValueError(f"max_seqlen: expected max(cache_seqlens), at most the {capacity} slots a sequence of "
                         f"this cache holds, got {max_seqlen}")
    if _host_readable(cache_seqlens) and cache_seqlens.numel() and int(cache_seqlens.max()) > max_seqlen:
        raise ValueError(f"max_seqlen: expected max(cache_seqlens) = {int(cache_seqlens.max())} (or None), got "
                         f"{max_seqlen}; the slots past it would be left out of the attention")


def mla_decode_with_kvcache(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                            block_table: Optional[torch.Tensor], cache_seqlens: torch.Tensor,
                            scale_cache: Optional[torch.Tensor] = None, *, softmax_scale,
                            num_splits: int = 0, backend: str = "auto", mode: str = "blockwise",
                            visible_lens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                            kv_format: Union[str, DenseRows] = "dense", indices: Optional[torch.Tensor] = None,
                            topk_length: Optional[torch.Tensor] = None):
    """Absorbed MLA decode attention over a latent cache, with optional key scalars.

    Args:
        q_lat: [B, S_q, H, d_c], latent queries with the query's norm scalar and both norm
            weights folded in.
        q_rope: [B, S_q, H, d_r], normalized, rotated RoPE queries.
        kv_cache: [num_blocks, block_size, d_c + d_r] rows [c ; k_rope] (bf16/fp16/fp32), or
            [B, capacity, d_c + d_r] when ``block_table`` is None (a contiguous cache); with a
            quantized ``kv_format``, uint8 [..., row bytes] rows (layout drawn in ``naive.py``).
        block_table: [B, max_blocks] int32/int64, or None for a contiguous cache. The ids past
            sequence b's ceil(cache_seqlens[b] / block_size) blocks are never read (pad them with
            -1 or 0, as vLLM does); one within that reach outside [0, num_blocks) is refused
            (except by the Triton kernel on CUDA tensors, where the check would cost a sync).
        cache_seqlens: [B], slots filled in each sequence, the S_q new tokens included.
        scale_cache: [num_blocks, block_size, G] (or [B, capacity, G]) key scalars r, or None
            for plain MLA.
        softmax_scale: the logit scale tau, a float or one per head [H] (then folded into the
            queries); required, by name: there is no default (MLA's is ``MLAConfig.scale``,
            (d_n + d_r) ** -0.5 with YaRN's correction; 1.0 would be unscaled logits).
        num_splits: split-K factor of the Triton kernel; 0 picks one that fills the GPU.
        backend: one of ``backends.DECODE_BACKENDS``; "auto" is resolved here (``backends.py``).
        mode: "blockwise" (r scales the content score) or "unified" (r scales the whole logit).
        visible_lens: [B, S_q] int, slots query t of sequence b sees (capped at its seqlen);
            None: causal among the S_q new tokens. Not with ``indices``.
        max_seqlen: max(cache_seqlens) if the caller knows it (spares the torch backend a
            device-to-host read).
        kv_format: one of ``qkmla.kv_formats.KV_FORMATS``: "dense", "fp8" (FlashMLA's
            656-byte rows at d_c 512, d_r 64), "int8" or "int4"; or the row format object
            itself (``kv_formats.row_format``), as ``LatentCache.decode_view()`` hands it over.
        indices: [B, S_q, topk] int32/int64, a sparse (top-k) decode: query t of sequence b
            attends to exactly the slots indices[b, t] lists (logical positions of the
            sequence, in any order, read through ``block_table``), rows and key scalars alike;
            -1 (or any position outside [0, cache_seqlens[b])) selects nothing. None: dense.
            FlashMLA's ``indices`` argument, with logical positions where FlashMLA takes
            physical ones (``naive.py`` draws the rule).
        topk_length: [B] int32/int64, with ``indices``: only the first topk_length[b] entries
            of indices[b] are read (FlashMLA's ``topk_length``); None: all topk.

    Returns:
        out [B, S_q, H, d_c] (q_lat's dtype) = softmax(s) @ c per head, and lse [B, S_q, H]
        (float32, float64 for float64 queries on the torch and naive backends; -inf with out = 0 where no slot
        is visible, a sparse query whose indices select nothing included). The layouts and the
        visibility rule are drawn in ``naive.py``.

    Raises:
        TypeError: ``softmax_scale`` not given (or given by position).
        ValueError: naming the argument, for any input of the wrong shape, dtype, device or
            value (``check_inputs``, ``softmax_scale``), an unknown ``backend`` or one that cannot run.

    Examples:
        >>> out, lse = mla_decode_with_kvcache(q_lat, q_rope, kv, table, lens, scales,  # doctest: +SKIP
        ...                                    softmax_scale=mla.scale)
    """
    check_backend(backend)
    # NumPy numbers are numbers, as select_backend's widths are: np.int64(8) as max_seqlen or num_splits, and
    # np.float32(0.3) as softmax_scale, were refused as "expected ... an int >= 0, got np.int64(8)".
    num_splits, max_seqlen = as_int(num_splits), as_int(max_seqlen)
    softmax_scale = as_number(softmax_scale)
    rows = check_inputs(q_lat, q_rope, kv_cache, block_table, cache_seqlens, scale_cache, mode, visible_lens,
                        kv_format)
    check_indices(indices, topk_length, q_lat, visible_lens)
    check_softmax_scale(softmax_scale, q_lat.shape[2], q_lat.device)
    capacity = kv_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    check_split_and_length(num_splits, max_seqlen, cache_seqlens, capacity)
    B, S_q, H, d_c = q_lat.shape
    if B * S_q * H == 0:  # nothing to attend for: every backend failed on an empty max() or reshape
        return (torch.zeros(B, S_q, H, d_c, dtype=q_lat.dtype, device=q_lat.device),
                torch.full((B, S_q, H), -math.inf, dtype=lse_dtype(q_lat), device=q_lat.device))
    backend = resolve_backend(backend, q_lat, q_rope, kv_cache, scale_cache, softmax_scale, rows)
    q_lat, q_rope, softmax_scale = fold_head_scale(q_lat, q_rope, softmax_scale)
    if block_table is not None:  # a table padded past a sequence's blocks (-1, as vLLM pads) reads as block 0 there
        block_table = clear_unreached_blocks(block_table, cache_seqlens, kv_cache.shape[1])
    if backend == "cpu":
        S = check_paged_reach(kv_cache, block_table, cache_seqlens, max_seqlen)
        if indices is not None:  # the kernel reads each query's selected slots, packed to the front
            slots, visible = packed_selection(indices, topk_length, cache_seqlens)
            return cpu_mla_decode(q_lat, q_rope, kv_cache, block_table, visible, scale_cache, float(softmax_scale),
                                  mode, slots=slots)
        visible = default_visible_lens(cache_seqlens, q_lat.shape[1]) if visible_lens is None else visible_lens
        visible = torch.minimum(visible.long(), cache_seqlens.long()[:, None]).clamp_(0, S)
        return cpu_mla_decode(q_lat, q_rope, kv_cache, block_table, visible, scale_cache, float(softmax_scale), mode)
    if backend == "torch":
        return torch_mla_decode(q_lat, q_rope, kv_cache, block_table, cache_seqlens, scale_cache, float(softmax_scale),
                                mode=mode, visible_lens=visible_lens, max_seqlen=max_seqlen, rows=rows,
                                indices=indices, topk_length=topk_length)
    if block_table is None:  # a contiguous cache is one block per sequence
        block_table = torch.arange(q_lat.shape[0], device=kv_cache.device)[:, None]
    if backend == "naive":
        # float64 queries are attended in float64, as the torch backend attends them (float32 was 2e-7 off):
        # the dtype its log-sum-exp is kept in, float32 otherwise
        out, lse = naive_mla_decode(q_lat, q_rope, kv_cache, block_table, cache_seqlens, scale_cache, softmax_scale,
                                    lse_dtype(q_lat), mode=mode, visible_lens=visible_lens, kv_format=rows,
                                    indices=indices, topk_length=topk_length)
        return out.to(q_lat.dtype), lse
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache: the Triton kernel needs the last dimension contiguous")
    # The kernel's partial results, one per split (out [B, S_q, H, splits, d_c] and lse, float32): num_splits=2**40
    # failed in torch's allocator ("DefaultCPUAllocator: can't allocate memory"), naming nothing. Asked only of a
    # size past 1 GiB (a decode step asks nothing of the driver otherwise), not while torch.compile traces (the
    # machine's memory is read from /proc, which dynamo cannot trace) nor while a CUDA graph is captured.
    partial = 4 * B * S_q * H * num_splits * (d_c + 1)
    if partial > 1 << 30 and not torch.compiler.is_compiling() \
            and not (q_lat.is_cuda and torch.cuda.is_current_stream_capturing()):
        check_allocation("num_splits", partial, f"the Triton kernel's partial results of num_splits={num_splits} "
                         f"splits", q_lat.device)
    if _host_readable(cache_seqlens) and _host_readable(block_table):
        # The kernel reads whatever a block id points at: where reading the ids is free (the
        # interpreter's CPU tensors) they are checked as the torch backend checks them.
        check_paged_reach(kv_cache, block_table, cache_seqlens, max_seqlen)
    # The kernel's dots take both operands in the cache's dtype; a quantized tile is
    # dequantized to the queries' own dtype (bf16/fp16, else float32).
    dot_dtype = kv_cache.dtype if not rows.quantized else \
        q_lat.dtype if q_lat.dtype in (torch.bfloat16, torch.float16) else torch.float32
    q, r = (t.to(dot_dtype).contiguous() for t in (q_lat, q_rope))
    if indices is not None:  # contiguous entries, and counts the kernel reads as int32
        indices = indices.contiguous()
        topk_length = topk_length.to(torch.int32) if topk_length is not None else None
    out, lse = _mla_decode_op(q, r, kv_cache, scale_cache, block_table, cache_seqlens, float(softmax_scale),
                              int(num_splits), mode == "unified", visible_lens, rows.name, indices, topk_length)
    return out.to(q_lat.dtype), lse
