"""Triton MLA decode over a paged latent cache, with the QK-norm key scalars.

Split-K (flash-decoding): grid (B * S_q, head blocks, splits). Each program runs an online
softmax over its share of the visible keys and writes an unnormalized partial output and
its log-sum-exp; a combine kernel merges the splits. Within a key tile:

    s = q_lat @ c^T                  latent dot products           [BLOCK_H, BLOCK_N]
    s = s * r[j, g(h)]               the key scalars (USE_SCALE)   before the RoPE score (blockwise)
    s = s + q_rope @ k_rope^T        RoPE scores
    s = s * r[j, g(h)]               the key scalars (USE_SCALE)   after it (UNIFIED)
    s = s * softmax_scale            then the online max/sum update

Plain MLA is the same kernel compiled with USE_SCALE=False. A quantized cache
(``qkmla.kv_formats``; KV_FORMAT 1 fp8, 2 int8, 3 int4, 0 dense) is read as bytes: a tile's
codes are loaded and dequantized in registers, c = code * scale[value // GROUP], with the
float32 scales and the bfloat16 RoPE key read at their byte offsets in the row
(:func:`_load_key_tile`); the dots then run in the queries' dtype. Each query's visible length is
causal among the new tokens, or read from ``visible_lens`` (HAS_VISIBLE). Masked loads never
touch slots past a query's visible length, so unused cache slots may hold anything (tests
use NaN). A sparse decode (HAS_INDICES) walks a query's entries of ``indices`` instead of its
slots: a tile is BLOCK_N entries, each entry's slot read through the block table, an entry
outside [0, seqlen) or past ``topk_length`` masked like a slot past the length (so a tile, or
a whole split, may hold no key). The reference is ``naive.py`` beside this file.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ...kv_formats import row_format


FORMAT_IDS = {"dense": 0, "fp8": 1, "int8": 2, "int4": 3}


@triton.jit
def _load_key_tile(p_row, m_n, o_c, o_r, D_C: tl.constexpr, KV_FORMAT: tl.constexpr, GROUP: tl.constexpr,
                   SCALE_OFF: tl.constexpr, ROPE_OFF: tl.constexpr):
    """(c [BLOCK_N, D_C], k_rope [BLOCK_N, D_R]) of the rows at p_row [BLOCK_N] (masked rows: 0);
    quantized rows come back dequantized, in float32."""
    if KV_FORMAT == 0:
        b_c = tl.load(p_row[:, None] + o_c[None, :], mask=m_n[:, None], other=0.0)
        b_kr = tl.load(p_row[:, None] + D_C + o_r[None, :], mask=m_n[:, None], other=0.0)
    else:
        if KV_FORMAT == 3:  # two codes per byte: value i in byte i // 2, low nibble first
            b_byte = tl.load(p_row[:, None] + (o_c // 2)[None, :], mask=m_n[:, None], other=0)
            b_code = ((b_byte >> ((o_c % 2) * 4)[None, :].to(tl.uint8)) & 0xF).to(tl.float32) - 8.0
        else:
            b_byte = tl.load(p_row[:, None] + o_c[None, :], mask=m_n[:, None], other=0)
            if KV_FORMAT == 1:
                b_code = b_byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                b_code = b_byte.to(tl.int8, bitcast=True).to(tl.float32)
        # one scale per GROUP values: loaded once per group, broadcast over the group's codes
        block_n: tl.constexpr = b_code.shape[0]
        o_g = tl.arange(0, D_C // GROUP)
        p_scale = (p_row + SCALE_OFF).to(tl.pointer_type(tl.float32))
        b_scale = tl.load(p_scale[:, None] + o_g[None, :], mask=m_n[:, None], other=0.0)
        b_c = tl.reshape(tl.reshape(b_code, (block_n, D_C // GROUP, GROUP)) * b_scale[:, :, None], (block_n, D_C))
        p_kr = (p_row + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))
        b_kr = tl.load(p_kr[:, None] + o_r[None, :], mask=m_n[:, None], other=0.0).to(tl.float32)
    return b_c, b_kr


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b; IEEE: float32 inputs multiplied in float32 (Triton's default on CUDA is TF32, 10 mantissa bits)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _mla_decode_split_kernel(
    q_lat_ptr, q_rope_ptr, kv_ptr, scale_ptr, block_table_ptr, seqlens_ptr, visible_ptr, o_part_ptr, lse_part_ptr,
    indices_ptr, topk_len_ptr, softmax_scale, topk,
    stride_qb, stride_qt, stride_qh,
    stride_rb, stride_rt, stride_rh,
    stride_kv_blk, stride_kv_tok,
    stride_s_blk, stride_s_tok,
    stride_bt,
    stride_vb, stride_vt,
    stride_ob, stride_ot, stride_oh, stride_os,
    stride_lb, stride_lt, stride_lh,
    stride_ib, stride_it,
    S_Q: tl.constexpr, H: tl.constexpr, HEADS_PER_GROUP: tl.constexpr, D_C: tl.constexpr, D_R: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    USE_SCALE: tl.constexpr, UNIFIED: tl.constexpr, HAS_VISIBLE: tl.constexpr, DOT_FP32: tl.constexpr,
    DOT_IEEE: tl.constexpr, KV_FORMAT: tl.constexpr, GROUP: tl.constexpr, SCALE_OFF: tl.constexpr,
    ROPE_OFF: tl.constexpr, HAS_INDICES: tl.constexpr, HAS_TOPK_LEN: tl.constexpr,
):
    i_bt, i_hb, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_t = i_bt // S_Q, i_bt % S_Q
    seqlen = tl.load(seqlens_ptr + i_b)
    if HAS_INDICES:  # the query's entries of indices (n_visible counts entries, not slots)
        if HAS_TOPK_LEN:
            n_visible = tl.maximum(tl.minimum(tl.load(topk_len_ptr + i_b), topk), 0)
        else:
            n_visible = topk
    elif HAS_VISIBLE:  # a per-query prefix (padded batches), never past the sequence's length
        n_visible = tl.maximum(tl.minimum(tl.load(visible_ptr + i_b * stride_vb + i_t * stride_vt), seqlen), 0)
    else:  # causal among the S_Q new tokens
        n_visible = tl.maximum(seqlen - S_Q + i_t + 1, 0)
    tiles = tl.cdiv(n_visible, BLOCK_N)
    tiles_per_split = tl.cdiv(tiles, NUM_SPLITS)
    start = i_s * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, n_visible)

    o_h = i_hb * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < H
    o_c = tl.arange(0, D_C)
    o_r = tl.arange(0, D_R)
    g_h = o_h // HEADS_PER_GROUP
    p_q = q_lat_ptr + i_b * stride_qb + i_t * stride_qt + o_h[:, None] * stride_qh + o_c[None, :]
    b_q = tl.load(p_q, mask=m_h[:, None], other=0.0)
    p_qr = q_rope_ptr + i_b * stride_rb + i_t * stride_rt + o_h[:, None] * stride_rh + o_r[None, :]
    b_qr = tl.load(p_qr, mask=m_h[:, None], other=0.0)
    if DOT_FP32:  # the CPU interpreter computes bf16 dots wrongly; GPUs keep bf16 inputs
        b_q, b_qr = b_q.to(tl.float32), b_qr.to(tl.float32)

    b_m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_H, D_C], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < end
        if HAS_INDICES:  # entry -> slot; an entry outside [0, seqlen) selects nothing
            i_pos = tl.load(indices_ptr + i_b * stride_ib + i_t * stride_it + o_n, mask=m_n, other=-1)
            m_n = m_n & (i_pos >= 0) & (i_pos < seqlen)
            o_n = tl.where(m_n, i_pos, 0)
        i_blk = tl.load(block_table_ptr + i_b * stride_bt + o_n // PAGE, mask=m_n, other=0).to(tl.int64)
        i_slot = o_n % PAGE
        p_row = kv_ptr + i_blk * stride_kv_blk + i_slot * stride_kv_tok
        b_c, b_kr = _load_key_tile(p_row, m_n, o_c, o_r, D_C, KV_FORMAT, GROUP, SCALE_OFF, ROPE_OFF)
        if DOT_FP32:
            b_c, b_kr = b_c.to(tl.float32), b_kr.to(tl.float32)
        else:  # a dequantized tile joins the queries' dtype (a no-op for a dense cache)
            b_c, b_kr = b_c.to(b_q.dtype), b_kr.to(b_q.dtype)
        b_s = _dot(b_q, tl.trans(b_c), DOT_IEEE)
        if USE_SCALE:
            p_r = scale_ptr + (i_blk * stride_s_blk + i_slot * stride_s_tok)[None, :] + g_h[:, None]
            b_r = tl.load(p_r, mask=m_h[:, None] & m_n[None, :], other=0.0).to(tl.float32)
            if not UNIFIED:
                b_s = b_s * b_r
        b_s = b_s + _dot(b_qr, tl.trans(b_kr), DOT_IEEE)
        if USE_SCALE:
            if UNIFIED:
                b_s = b_s * b_r
        b_s = b_s * softmax_scale
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))  # finite unless sparse: every tile holds a visible key
        b_m_ref = b_m_new
        if HAS_INDICES:  # no key selected yet: keep exp(-inf - m) = 0, not exp(-inf + inf) = NaN
            b_m_ref = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
        b_alpha = tl.exp(b_m - b_m_ref)
        b_p = tl.exp(b_s - b_m_ref[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_c.dtype), b_c, DOT_IEEE)
        b_m = b_m_new

    has_keys = b_l > 0
    b_o = b_acc / tl.where(has_keys, b_l, 1.0)[:, None]
    b_lse = tl.where(has_keys, b_m + tl.log(tl.where(has_keys, b_l, 1.0)), float("-inf"))
    p_o = o_part_ptr + i_b * stride_ob + i_t * stride_ot + o_h[:, None] * stride_oh + i_s * stride_os + o_c[None, :]
    tl.store(p_o, b_o, mask=m_h[:, None])
    p_lse = lse_part_ptr + i_b * stride_lb + i_t * stride_lt + o_h * stride_lh + i_s
    tl.store(p_lse, b_lse, mask=m_h)


@triton.jit
def _mla_decode_combine_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, lse_ptr,
    stride_ob, stride_ot, stride_oh, stride_os,
    stride_lb, stride_lt, stride_lh,
    stride_fb, stride_ft, stride_fh,
    stride_gb, stride_gt,
    S_Q: tl.constexpr, D_C: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    i_bt, i_h = tl.program_id(0), tl.program_id(1)
    i_b, i_t = i_bt // S_Q, i_bt % S_Q
    o_s = tl.arange(0, SPLITS_P2)
    m_s = o_s < NUM_SPLITS
    b_lse = tl.load(lse_part_ptr + i_b * stride_lb + i_t * stride_lt + i_h * stride_lh + o_s, mask=m_s,
                    other=float("-inf"))
    b_max = tl.max(b_lse, axis=0)
    safe_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w = tl.exp(b_lse - safe_max)  # 0 for splits without keys
    b_sum = tl.sum(b_w, axis=0)
    o_c = tl.arange(0, D_C)
    p_o = o_part_ptr + i_b * stride_ob + i_t * stride_ot + i_h * stride_oh + o_s[:, None] * stride_os + o_c[None, :]
    b_o = tl.load(p_o, mask=m_s[:, None] & (b_w[:, None] > 0), other=0.0)
    b_out = tl.sum(b_o * b_w[:, None], axis=0) / tl.where(b_sum > 0, b_sum, 1.0)
    tl.store(out_ptr + i_b * stride_fb + i_t * stride_ft + i_h * stride_fh + o_c, b_out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + i_b * stride_gb + i_t * stride_gt + i_h,
             tl.where(b_sum > 0, safe_max + tl.log(tl.where(b_sum > 0, b_sum, 1.0)), float("-inf")))


def default_num_splits(batch_tokens: int, head_blocks: int, max_tokens: int, block_n: int, device) -> int:
    """Enough programs to fill the GPU (about two waves), never more splits than key tiles."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = max(1, math.ceil(max_tokens / block_n))
    return max(1, min(tiles, math.ceil(2 * sms / max(1, batch_tokens * head_blocks)), 64))


# Launch configurations (BLOCK_H at most, BLOCK_N, num_stages), preferred first; a program of
# more than 16 heads gets 8 warps (its [BLOCK_H, d_c] accumulator spills registers with 4). The
# key and value tiles live in shared memory, so what fits depends on the heads per program, the
# row format and the GPU (an H100 allows 227 KiB per program): a launch that does not fit is
# refused by Triton before it runs, and the next configuration is tried.
LAUNCH_CONFIGS = ((64, 64, 3), (64, 32, 3), (64, 16, 2), (32, 16, 2), (16, 16, 2))
_fitting: dict = {}  # (what decides the kernel's shared memory) -> index into LAUNCH_CONFIGS that fit


def launch_config(H: int, batch_tokens: int, max_tokens: int, device, index: int = 0, num_splits: int = 0) -> dict:
    """The split kernel's launch for ``LAUNCH_CONFIGS[index]``: BLOCK_H, BLOCK_N, head blocks,
    splits (``num_splits`` if positive, else :func:`default_num_splits`), warps and stages."""
    cap, block_n, num_stages = LAUNCH_CONFIGS[index]
    block_h = max(16, min(cap, triton.next_power_of_2(H)))
    num_warps = 4 if block_h <= 16 else 8
    head_blocks = triton.cdiv(H, block_h)
    if num_splits <= 0:
        num_splits = default_num_splits(batch_tokens, head_blocks, max_tokens, block_n, device)
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "head_blocks": head_blocks, "num_splits": num_splits,
            "num_warps": num_warps, "num_stages": num_stages}


def fitting_config(q_lat, kv_cache, scale_cache, unified: bool, kv_format: str) -> int:
    """The index into ``LAUNCH_CONFIGS`` that the last launch of this kind fitted (0 before any)."""
    return _fitting.get(_config_key(q_lat, kv_cache, scale_cache, unified, kv_format), 0)


def _config_key(q_lat, kv_cache, scale_cache, unified, kv_format) -> tuple:
    """What decides the split kernel's shared memory: heads, widths (the row's holds d_r), dtypes."""
    return (q_lat.device, q_lat.shape[2], q_lat.shape[3], q_lat.dtype, kv_cache.shape[-1], kv_cache.dtype,
            kv_format, None if scale_cache is None else scale_cache.dtype, unified)


def split_kernel_args(q_lat, q_rope, kv_cache, scale_cache, block_table, cache_seqlens, softmax_scale, o_part,
                      lse_part, launch: dict, unified: bool = False, visible_lens=None, dot_fp32: bool = False,
                      kv_format: str = "dense", indices=None, topk_length=None) -> tuple[tuple, dict]:
    """(positional arguments, constexprs and launch options) of ``_mla_decode_split_kernel`` for
    these tensors and ``launch`` (:func:`launch_config`); o_part [B, S_q, H, splits, d_c] and
    lse_part [B, S_q, H, splits] are its float32 outputs. ``indices`` [B, S_q, topk] (entries
    contiguous) and ``topk_length`` [B] int32: a sparse decode."""
    B, S_q, H, d_c = q_lat.shape
    d_r = q_rope.shape[-1]
    group, scale_off, rope_off = 1, 0, 0
    fmt = row_format(kv_format, d_c, d_r)
    if fmt.quantized:
        # a scale covers min(group, d_c) values: a latent narrower than a group has one scale
        group, scale_off, rope_off = min(fmt.group_size, d_c), fmt.layout.scale_offset, fmt.layout.rope_offset
    G = scale_cache.shape[-1] if scale_cache is not None else 1
    scales = scale_cache if scale_cache is not None else kv_cache  # never read when USE_SCALE is False
    visible = visible_lens if visible_lens is not None else cache_seqlens[:, None]  # never read without HAS_VISIBLE
    # never read without HAS_INDICES / HAS_TOPK_LEN
    entries = indices if indices is not None else cache_seqlens[:, None, None]
    counts = topk_length if topk_length is not None else cache_seqlens
    if indices is not None and indices.stride(-1) != 1:
        raise ValueError("indices: the Triton kernel needs each query's entries contiguous")
    args = (q_lat, q_rope, kv_cache, scales, block_table, cache_seqlens, visible, o_part, lse_part, entries, counts,
            softmax_scale, entries.shape[-1],
            q_lat.stride(0), q_lat.stride(1), q_lat.stride(2),
            q_rope.stride(0), q_rope.stride(1), q_rope.stride(2),
            kv_cache.stride(0), kv_cache.stride(1),
            scales.stride(0), scales.stride(1),
            block_table.stride(0),
            visible.stride(0), visible.stride(1),
            o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
            lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
            entries.stride(0), entries.stride(1))
    constexprs = dict(S_Q=S_q, H=H, HEADS_PER_GROUP=H // G, D_C=d_c, D_R=d_r, PAGE=kv_cache.shape[1],
                      BLOCK_H=launch["BLOCK_H"], BLOCK_N=launch["BLOCK_N"], NUM_SPLITS=launch["num_splits"],
                      USE_SCALE=scale_cache is not None, UNIFIED=unified, HAS_VISIBLE=visible_lens is not None,
                      DOT_FP32=dot_fp32, DOT_IEEE=q_lat.dtype == torch.float32, KV_FORMAT=FORMAT_IDS[kv_format],
                      GROUP=group, SCALE_OFF=scale_off, ROPE_OFF=rope_off, HAS_INDICES=indices is not None,
                      HAS_TOPK_LEN=topk_length is not None)
    return args, {**constexprs, "num_warps": launch["num_warps"], "num_stages": launch["num_stages"]}


def mla_decode_fwd(q_lat, q_rope, kv_cache, scale_cache, block_table, cache_seqlens, softmax_scale: float,
                   num_splits: int = 0, unified: bool = False, visible_lens=None,
                   dot_fp32: bool = False, kv_format: str = "dense", launch_index: Optional[int] = None,
                   indices=None, topk_length=None):
    """Launch split + combine; returns (out [B, S_q, H, d_c] in q_lat's dtype, lse [B, S_q, H] float32).
    ``dot_fp32``: run the tile dots in fp32 (Triton's CPU interpreter needs it). ``kv_format``:
    the rows' format (a quantized one's kv_cache is uint8 bytes). Float32 queries take IEEE
    float32 dots, not TF32, so that a float32 decode matches the float32 reference.
    ``launch_index``: run ``LAUNCH_CONFIGS[launch_index]`` only (benchmarks compare them; Triton's
    OutOfResources if it does not fit); None: the first that fits. ``indices`` [B, S_q, topk]
    (entries contiguous) and ``topk_length`` [B] int32 or None: a sparse decode, split over topk
    entries instead of the cache's slots."""
    from triton.runtime.errors import OutOfResources

    B, S_q, H, d_c = q_lat.shape
    key = _config_key(q_lat, kv_cache, scale_cache, unified, kv_format)
    tried = range(_fitting.get(key, 0), len(LAUNCH_CONFIGS)) if launch_index is None else [launch_index]
    for index in tried:
        longest = indices.shape[-1] if indices is not None else block_table.shape[1] * kv_cache.shape[1]
        launch = launch_config(H, B * S_q, longest, q_lat.device, index, num_splits)
        splits = launch["num_splits"]
        o_part = torch.empty(B, S_q, H, splits, d_c, dtype=torch.float32, device=q_lat.device)
        lse_part = torch.empty(B, S_q, H, splits, dtype=torch.float32, device=q_lat.device)
        args, options = split_kernel_args(q_lat, q_rope, kv_cache, scale_cache, block_table, cache_seqlens,
                                          softmax_scale, o_part, lse_part, launch, unified, visible_lens, dot_fp32,
                                          kv_format, indices, topk_length)
        try:
            _mla_decode_split_kernel[(B * S_q, launch["head_blocks"], splits)](*args, **options)
        except OutOfResources:
            if launch_index is not None or index + 1 == len(LAUNCH_CONFIGS):
                raise
            continue
        if launch_index is None:
            _fitting[key] = index
        break
    out = torch.empty(B, S_q, H, d_c, dtype=q_lat.dtype, device=q_lat.device)
    lse = torch.empty(B, S_q, H, dtype=torch.float32, device=q_lat.device)
    _mla_decode_combine_kernel[(B * S_q, H)](
        o_part, lse_part, out, lse,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1),
        S_Q=S_q, D_C=d_c, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
    )
    return out, lse
