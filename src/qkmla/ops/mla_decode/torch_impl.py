"""The torch backend of the MLA decode op: dense absorbed latent attention in a few large GEMMs.

:func:`torch_mla_decode` reads the paged or contiguous cache the op takes. A contiguous
cache is sliced to its visible rows (no copy) and read by :func:`latent_attention`; a paged
one is read in one pass by :func:`_paged_attend`, a chunk of blocks at a time folded into a
running softmax, so the context is never gathered whole. Quantized rows (``qkmla.kv_formats``) stay
bytes until a chunk of keys is read: each chunk is dequantized for its score GEMMs and
again for its value GEMM, so the float cache is never held whole. The arithmetic is ordered for CPUs and
eager mode: scores key-major in cache-sized chunks, the softmax in place, normalized after
the value GEMM. The specification is ``naive.py`` beside this file.

Shapes follow [B, T, H, D]: B sequences, T query tokens, S cached tokens, h query heads,
G KV groups (head i reads group i // (h / G)).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ...dtypes import accumulate_dtype, cast
from ...kv_formats import DenseRows, row_format
from .differentiable import differentiable_decode, recording
from .naive import default_visible_lens
from .selection import packed_selection
from .workspace import scratch

SCORE_CHUNK = 4096  # keys per score GEMM (over the batch, when paged): 4096 fp32 rows of d_c + d_r = 576 are 9.4 MB
# Rows a sparse decode gathers at once (over the batch's queries): a prefill chunk of 512 queries
# with topk 2048 would otherwise copy 1M rows (2.4 GB in float32) before attending to any.
GATHER_ROWS = 65536



def lse_dtype(q_lat: torch.Tensor) -> torch.dtype:
    """The log-sum-exp's dtype: float32, or float64 for float64 queries, whose scores are float64. Rounded to
    float32, a sink's share sigmoid(L - s_h) of a float64 decode was 5e-9 off the float64 reference."""
    return accumulate_dtype(q_lat.dtype)

def _chunks(S: int) -> list[tuple[int, int]]:
    """(start, stop) of equal chunks of about SCORE_CHUNK keys: a context of 4096 k + 1
    tokens should not pay a whole chunk's worth of calls for its last key."""
    size = max(1, -(-S // max(1, round(S / SCORE_CHUNK))))
    return [(start, min(start + size, S)) for start in range(0, S, size)]


def _rows_reader(latent: torch.Tensor, rows: Optional[DenseRows], dtype: torch.dtype):
    """read(start, stop) -> keys start..stop-1 as [B, n, d_c + d_r] in ``dtype``: a slice of a
    dense cache (cast once, whole), or a chunk of quantized rows dequantized on its own."""
    if rows is None or not rows.quantized:
        latent = cast(latent, dtype)
        return lambda start, stop: latent[:, start:stop]
    return lambda start, stop: cast(rows.decode(latent[:, start:stop]), dtype)


def fold_head_scale(q_lat: torch.Tensor, q_rope: torch.Tensor, softmax_scale) -> tuple:
    """(q_lat, q_rope, scale) with a per-head scale [h] folded into the queries and 1.0 left
    (O(h d) work, not O(h S)); a float scale is returned as it is."""
    if not isinstance(softmax_scale, torch.Tensor):
        return q_lat, q_rope, softmax_scale
    head = softmax_scale.to(q_lat.dtype)[:, None]
    return q_lat * head, q_rope * head, 1.0


def _key_major_scores(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                      key_scale: Optional[torch.Tensor], mode: str, rows: Optional[DenseRows] = None) -> torch.Tensor:
    """Logits laid out key-major, [B, S, T, h].

    Key-major is the faster orientation for CPU BLAS: latent [S, d] @ q^T [d, T h] streams the
    cache row by row, where q @ latent^T reads it with a long stride.
    The keys go in chunks of about SCORE_CHUNK that fit in the last-level cache: with a blockwise
    QK norm the content (K = d_c) and RoPE (K = d_r) GEMMs read the same rows, and the
    second finds them there instead of in DRAM; plain MLA's single GEMM is chunked alike,
    so the two paths compare like with like. Unified mode scales the whole logit, so it
    needs plain MLA's one GEMM and a multiply. ``rows``: the format of quantized rows
    (None or dense: ``latent`` holds values), dequantized chunk by chunk.
    """
    B, T, h, d_c = q_lat.shape
    S = latent.shape[1]
    acc = accumulate_dtype(q_lat.dtype)
    read = _rows_reader(latent, rows, q_lat.dtype)
    split = key_scale is not None and mode == "blockwise"
    # A half-precision batched GEMM on the CPU takes oneDNN's fast path only over whole
    # contiguous rows, and the content and RoPE blocks of a row are strided slices of it
    # (several times slower at batch > 1). There both blocks go through one GEMM over the
    # whole row against a block-diagonal query [[q_c, 0], [0, q_r]]: twice the (cheap,
    # memory-bound) flops, one read of the keys.
    joint = split and q_lat.dtype in (torch.float16, torch.bfloat16) and q_lat.device.type == "cpu"
    if joint:
        q_blk = q_lat.new_zeros(B, d_c + q_rope.shape[-1], 2 * T * h)
        q_blk[:, :d_c, :T * h] = q_lat.reshape(B, T * h, d_c).transpose(1, 2)
        q_blk[:, d_c:, T * h:] = q_rope.reshape(B, T * h, -1).transpose(1, 2)
    elif split:  # r scales only the content score
        q_c_t = q_lat.reshape(B, T * h, d_c).transpose(1, 2)
        q_r_t = q_rope.reshape(B, T * h, -1).transpose(1, 2)
    else:
        q_t = torch.cat((q_lat, q_rope), dim=-1).reshape(B, T * h, -1).transpose(1, 2)
    if key_scale is not None:
        r, grouped = _by_group(key_scale, acc, T, h)

    # Every chunk's GEMM writes straight into one logit buffer: a list of chunk outputs
    # joined by torch.cat would allocate and copy the logits a second time (at 16k keys a
    # fresh MB, page faults included).
    s = torch.empty(B, S, T * h, dtype=acc, device=q_lat.device)
    for start, stop in _chunks(S):
        keys, s_chunk = read(start, stop), s[:, start:stop]
        if joint:  # s = r * (q_c . c) + q_r . k_r from one GEMM's two halves
            both = torch.bmm(keys, q_blk)
            s_chunk.copy_(both[..., T * h:])
            grouped(s_chunk).addcmul_(grouped(both[..., :T * h]), r[:, start:stop])
            continue
        if not split:
            _bmm_into(s_chunk, keys, q_t)
            if key_scale is not None:  # unified: s = r[j, g] * (q_lat . c_j + q_rope . k_rope_j)
                grouped(s_chunk).mul_(r[:, start:stop])
            continue
        # r scales the content score before the RoPE score joins, both in place: the RoPE
        # GEMM accumulates into the content GEMM's output (beta = 1).
        _bmm_into(s_chunk, keys[..., :d_c], q_c_t)
        grouped(s_chunk).mul_(r[:, start:stop])
        rope = keys[..., d_c:]
        if s.dtype == rope.dtype:
            s_chunk.baddbmm_(rope, q_r_t)
        else:  # a half-precision GEMM, summed in float32
            s_chunk.add_(torch.bmm(rope, q_r_t))
    return s.view(B, S, T, h)


def _by_group(key_scale: torch.Tensor, acc: torch.dtype, T: int, h: int):
    """(r, grouped): key scalars [B, S, G] in ``acc``, shaped to broadcast against
    ``grouped(s)``, a view of logits s [B, n, T h] as [B, n, T, G, h/G] (n keys, any slice of
    the S). With one query token and one head per group, [B, n, h] already lines up with r."""
    G = key_scale.shape[-1]
    r = cast(key_scale, acc)
    if T == 1 and G == h:
        return r, lambda s: s
    return r[:, :, None, :, None], lambda s: s.view(s.shape[0], -1, T, G, h // G)


def _amax_over_keys(s: torch.Tensor) -> torch.Tensor:
    """max over dim 1 of s [B, S, N], as [B, 1, N].

    The CPU reduction kernel is slow over many short rows (one query token, few heads), so
    k consecutive key rows are first folded into one row of k N values (a view), and the
    k partial maxima reduced after; the S mod k rows left over are reduced on their own.
    """
    B, S, N = s.shape
    k = max(1, 256 // N)
    main = S - S % k
    if main == 0:
        return s.amax(dim=1, keepdim=True)
    m = s[:, :main].reshape(B, main // k, k * N).amax(dim=1).view(B, k, N).amax(dim=1, keepdim=True)
    if main < S:
        m = torch.maximum(m, s[:, main:].amax(dim=1, keepdim=True))
    return m


def _bmm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out = a @ b, written in place (out may be wider than a @ b's dtype)."""
    recording = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if out.dtype == a.dtype and not recording:  # out= is not differentiable; copy_ is
        torch.bmm(a, b, out=out)
    else:
        out.copy_(torch.bmm(a, b))


def latent_scores(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                  key_scale: Optional[torch.Tensor], mode: str = "blockwise") -> torch.Tensor:
    """Pre-softmax logits of the absorbed path (queries already carry the logit scale).

    The content score is the raw latent dot product scaled by the key's group scalar r
    (the query's scalar is already in q_lat), MATH.md S^C[i, j] = rho_q[i] (Q_lat C^T)[i, j] r[j, g(i)]:

        blockwise: s = r[j, g] * (q_lat . c_j) + q_rope . k_rope_j
        unified:   s = r[j, g] * (q_lat . c_j + q_rope . k_rope_j)
        plain:     s = [q_lat, q_rope] . latent_j              (one GEMM over d_c + d_r)

    Args:
        q_lat: [B, T, h, d_c]; q_rope: [B, T, h, d_r];
        latent: [B, S, d_c + d_r] = [c ; k_rope]; key_scale: [B, S, G] or None.

    Returns:
        [B, T, h, S] in at least float32 (a permuted view).
    """
    return _key_major_scores(q_lat, q_rope, latent, key_scale, mode).permute(0, 2, 3, 1)


def latent_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                     key_scale: Optional[torch.Tensor], softmax_scale: float, mask: Optional[torch.Tensor] = None,
                     mode: str = "blockwise", return_lse: bool = False, kv_format: Union[str, DenseRows] = "dense"):
    """Absorbed MLA attention over a dense (gathered) latent cache.

    Args:
        q_lat: [B, T, h, d_c] latent queries (query scalar and both norm weights folded in).
        q_rope: [B, T, h, d_r] normalized, rotated RoPE queries.
        latent: [B, S, d_c + d_r] cached [c ; k_rope], or uint8 [B, S, row bytes] rows of a
            quantized ``kv_format`` (dequantized a chunk of keys at a time).
        key_scale: [B, S, G] key scalars, or None for plain MLA.
        softmax_scale: logit scale, folded into the queries (O(h d) work, not O(h S)).
        mask: [B, T, S] bool or None; rows with no visible key give 0.
        mode: "blockwise" or "unified".
        kv_format: one of ``qkmla.kv_formats.KV_FORMATS``, or its row format object.

    Returns:
        o_lat [B, T, h, d_c] = softmax(s) @ c, and with ``return_lse`` the log-sum-exp
        [B, T, h] (float32) of the scaled logits, so W_UV can be applied afterwards.
    """
    B, T, h, d_c = q_lat.shape
    rows = row_format(kv_format, d_c, q_rope.shape[-1])
    s = _key_major_scores(q_lat * softmax_scale, q_rope * softmax_scale, latent, key_scale, mode, rows)  # [B, S, T, h]
    S = s.shape[1]
    if mask is not None:
        s.masked_fill_(~mask.transpose(1, 2)[..., None], float("-inf"))
    # The softmax runs in place and is normalized after the value GEMM, as flash attention
    # does: no second [B, S, T, h] buffer, and the division touches T h d_c values, not S T h.
    m = _amax_over_keys(s.view(B, S, T * h)).view(B, 1, T, h)
    if mask is not None:  # a row with no visible key has m = -inf: keep exp(s - m) = 0 there
        m = m.clamp_min(torch.finfo(m.dtype).min)
    p = s.sub_(m).exp_()
    # The row sum is >= 1 where a key is visible (the max contributes exp(0) = 1) and 0
    # where none is, so clamping at 1 turns only the latter's 0 / 0 into 0.
    row_sum = p.sum(dim=1)  # [B, T, h]
    denom = row_sum.clamp_min(1.0) if mask is not None else row_sum
    # p^T [T h, S] @ c [S, d_c], summed over the score chunks: BLAS streams c's rows into a
    # small [T h, d_c] output, where c^T @ p (a [d_c, T h] output) reduces over a long
    # transposed operand; quantized rows are dequantized again chunk by chunk, as for the scores.
    # Half-precision chunks are summed in float32, as one GEMM over all keys would accumulate.
    p_t = cast(p, q_lat.dtype).view(B, S, T * h).transpose(1, 2)
    read, o = _rows_reader(latent, rows, q_lat.dtype), None
    for start, stop in _chunks(S):
        values, weights = read(start, stop)[..., :d_c], p_t[..., start:stop]
        if o is None:
            o = cast(torch.bmm(weights, values), accumulate_dtype(q_lat.dtype))
        elif o.dtype == values.dtype:
            o.baddbmm_(weights, values)
        else:
            o.add_(torch.bmm(weights, values))
    o_lat = cast(o.div_(denom.view(B, T * h, 1)), q_lat.dtype).view(B, T, h, d_c)
    if return_lse:
        lse = m.squeeze(1) + torch.log(row_sum)  # [B, T, h]; -inf where no key is visible
    return (o_lat, lse) if return_lse else o_lat


@torch.library.custom_op("qkmla::latent_attention", mutates_args=())
def latent_attention_op(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                        key_scale: Optional[torch.Tensor], softmax_scale: float, visible_lens: torch.Tensor,
                        mode: str, kv_format: str = "dense") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`latent_attention` (with the log-sum-exp) as one opaque op for ``torch.compile``.

    Its arithmetic is ordered for the CPU's BLAS (chunks the last-level cache holds, in-place
    softmax); traced op by op, inductor would reorder it into a form that reads the cache
    more often. A compiled decode step calls this op and compiles everything around it.

    The step hands it the cache's whole buffers, [B, capacity, ...], so that its shapes never
    change, and how many slots each query sees, visible_lens [B, T] (sequence b has filled
    max_t visible_lens[b, t] slots). Here, outside the graph, only the slots up to the
    longest sequence's last are read (a cache built for 32k tokens that holds 2k costs 2k),
    and a batch whose queries all see every one of them needs no mask. Reading the lengths
    on the host costs a device sync per call on a GPU, where the Triton backend is the path.
    """
    B, T = q_lat.shape[:2]
    if (visible_lens.dtype.is_floating_point or visible_lens.dtype == torch.bool or visible_lens.shape != (B, T)
            or bool((visible_lens < 0).any()) or bool((visible_lens > latent.shape[1]).any())):
        raise ValueError(f"visible_lens: expected an integer tensor [B={B}, T={T}] of slot counts in "
                         f"[0, {latent.shape[1]}] (the cache's capacity), got {visible_lens.dtype} "
                         f"{tuple(visible_lens.shape)}")
    lengths = visible_lens.amax(dim=1)
    S = int(lengths.max())
    if S == 0:  # nothing visible anywhere: out = 0 and lse = -inf
        return q_lat.new_zeros(q_lat.shape), q_lat.new_full(q_lat.shape[:3], float("-inf"), dtype=lse_dtype(q_lat))
    out, lse = _attend_visible(q_lat, q_rope, latent[:, :S], None if key_scale is None else key_scale[:, :S],
                               visible_lens, lengths, softmax_scale, mode,
                               row_format(kv_format, q_lat.shape[-1], q_rope.shape[-1]))
    # Both outputs contiguous, whatever q_lat's strides: inductor checks a custom op's outputs
    # against the strides of its fake, and the fake below promises contiguous ones.
    return out.contiguous(), lse.contiguous()


@latent_attention_op.register_fake
def _(q_lat, q_rope, latent, key_scale, softmax_scale, visible_lens, mode, kv_format="dense"):
    # Not empty_like(q_lat): that keeps q_lat's strides (a transposed query in a compiled
    # step), which the real op's output does not have.
    return q_lat.new_empty(q_lat.shape), q_lat.new_empty(q_lat.shape[:3], dtype=lse_dtype(q_lat))


def _check_block_table(pool: torch.Tensor, block_table: torch.Tensor, length: int) -> None:
    """Refuse a table whose first blocks for ``length`` slots are missing or outside the pool.
    The op hands over a table whose ids past each sequence's own blocks are 0
    (``interface.clear_unreached_blocks``), so an id refused here is one a sequence reads."""
    n = -(-length // pool.shape[1])
    ids = block_table[:, :n].long()
    # A negative id would index from the pool's end: another sequence's rows, read silently.
    if n > ids.shape[1] or bool((ids < 0).any()) or bool((ids >= pool.shape[0]).any()):
        raise ValueError(f"block_table: the ids of the blocks each sequence's length reaches (the first "
                         f"ceil(cache_seqlens[b] / block_size) of row b, up to {n}) must lie in [0, num_blocks="
                         f"{pool.shape[0]}), got ids {ids.min().item() if ids.numel() else None}.."
                         f"{ids.max().item() if ids.numel() else None} over {ids.shape[1]} blocks; the ids past "
                         f"them are not read (-1 or 0 pads them)")


def _block_scores(q_lat: torch.Tensor, q_rope: torch.Tensor, c: torch.Tensor, k_rope: torch.Tensor,
                  key_scale: Optional[torch.Tensor], mode: str) -> torch.Tensor:
    """Logits [B, n, T h] (at least float32) from the two blocks of n keys held apart, each
    contiguous: c [B, n, d_c], k_rope [B, n, d_r], key_scale [B, n, G] or None.

    Two GEMMs whose depths add up to plain MLA's one (d_c + d_r) and one pass that joins them:
    plain s = q_c . c + q_r . k_r, blockwise s = r (q_c . c) + q_r . k_r, unified s = r (q_c . c + q_r . k_r).
    """
    B, T, h, d_c = q_lat.shape
    acc = accumulate_dtype(q_lat.dtype)
    content = torch.bmm(c, q_lat.reshape(B, T * h, d_c).transpose(1, 2))  # [B, n, T h]
    rope = torch.bmm(k_rope, q_rope.reshape(B, T * h, -1).transpose(1, 2))
    if key_scale is None:
        return cast(content, acc).add_(rope)
    r, grouped = _by_group(key_scale, acc, T, h)
    if mode == "unified":
        return grouped(cast(content, acc).add_(rope)).mul_(r).view(B, -1, T * h)
    # r is float32 or wider, so addcmul computes (and returns) the sum in that precision.
    return torch.addcmul(grouped(rope), grouped(content), r).view(B, -1, T * h)


def _read_blocks(table: torch.Tensor, ids: torch.Tensor, role: str) -> torch.Tensor:
    """table [num_blocks, block, width] -> the blocks ``ids`` [B, k] as [B, k block, width],
    copied into a buffer kept for ``role`` (``workspace.py``).

    Whole blocks, not slots: one index per block (block rows of a column slice, as vLLM hands
    over [..., :d_c] of its rows [c | k_rope | r]) instead of one per slot of a
    [num_blocks * block, width] view, which was several times slower for the same bytes on the
    CPU measured (docs/benchmarks.md, bench_paged_layouts.py)."""
    B, k = ids.shape
    if torch.is_grad_enabled() and table.requires_grad:  # a cache written under autograd: out= would refuse it
        return table.index_select(0, ids.flatten()).view(B, -1, table.shape[-1])
    out = scratch(role, (B * k, *table.shape[1:]), table.dtype, table.device)
    return torch.index_select(table, 0, ids.flatten(), out=out).view(B, -1, table.shape[-1])


def _paged_attend(q_lat: torch.Tensor, q_rope: torch.Tensor, pool: torch.Tensor, scale_pool: Optional[torch.Tensor],
                  block_table: torch.Tensor, S: int, visible: torch.Tensor, lengths: torch.Tensor,
                  softmax_scale: float, mode: str, rows: DenseRows) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`latent_attention` over a paged cache in one pass, a chunk of blocks at a time:
    each chunk's rows are gathered (about SCORE_CHUNK keys over the whole batch, a size the
    last-level cache holds), scored, and folded into a running softmax
    (max m, sum l, output o, as flash decoding does), so the context is read once and never
    copied whole.

    A chunk's blocks are copied (:func:`_read_blocks`) into buffers kept between calls
    (``workspace.py``), dense rows as two contiguous blocks, c [B, n, d_c] and k_rope
    [B, n, d_r]: contiguous GEMM operands (a half-precision GEMM over strided rows leaves
    oneDNN's fast path), and the value GEMM reads c alone. Plain MLA takes the same copies and
    the same two GEMMs, so a QK-normed decode differs from a plain one only by its key scalars'
    copy and multiply.

    pool [num_blocks, block, width] (values, or uint8 rows of a quantized ``rows`` format), scale_pool
    [num_blocks, block, G] or None, block_table [B, max_blocks], visible [B, T] slots seen by
    each query, lengths [B] slots filled. Returns (out [B, T, h, d_c], lse [B, T, h] float32, float64 for float64
    queries).
    """
    B, T, h, d_c = q_lat.shape
    block = pool.shape[1]
    q_lat, q_rope = q_lat * softmax_scale, q_rope * softmax_scale
    acc = accumulate_dtype(q_lat.dtype)
    visible = torch.minimum(visible.long(), lengths.long()[:, None])
    masked = not bool((visible >= S).all())  # the steady state of batched decoding needs no mask
    m = q_lat.new_full((B, 1, T * h), float("-inf"), dtype=acc)
    l = q_lat.new_zeros((B, T * h), dtype=acc)  # noqa: E741 (flash attention's name)
    o = q_lat.new_zeros((B, T * h, d_c), dtype=acc)
    # Chunks are sized over the batch, not per sequence: B times as many keys would be B
    # times the bytes, past the last-level cache and into fresh pages on every call.
    per_chunk, n_blocks = max(1, SCORE_CHUNK // (block * B)), -(-S // block)
    shortest = int(lengths.min())  # read once: on a GPU each read is a sync
    for first in range(0, n_blocks, per_chunk):
        ids = block_table[:, first:min(first + per_chunk, n_blocks)].long()
        slots = torch.arange(first * block, (first + ids.shape[1]) * block, device=q_lat.device)
        if not rows.quantized:  # values read in the queries' dtype (a bf16 cache may serve float32 queries)
            keys = [cast(_read_blocks(pool[..., :d_c], ids, "c"), q_lat.dtype),
                    cast(_read_blocks(pool[..., d_c:], ids, "k_rope"), q_lat.dtype)]
        else:  # quantized rows stay bytes
            keys = [_read_blocks(pool, ids, "rows")]
        r = None if scale_pool is None else _read_blocks(scale_pool, ids, "key_scale")
        # Slots a sequence has not filled may hold anything (NaN, stale rows), and 0 weight times
        # NaN is still NaN in p @ c: they are zeroed, from the first one in any sequence on.
        unfilled = max(0, shortest - first * block)
        if unfilled < slots.numel():
            beyond = (slots >= lengths[:, None])[:, unfilled:, None]  # [B, n - unfilled, 1]
            for rows_read in keys + ([] if r is None else [r]):
                rows_read[:, unfilled:].masked_fill_(beyond, 0)
        if not rows.quantized:
            s = _block_scores(q_lat, q_rope, *keys, r, mode)  # [B, n, T h]
            values = keys[0]
        else:
            s = _key_major_scores(q_lat, q_rope, keys[0], r, mode, rows).view(B, -1, T * h)
            # p^T @ [c ; k_rope] over whole rows (a contiguous operand), the c columns kept.
            values = _rows_reader(keys[0], rows, q_lat.dtype)(0, slots.numel())
        if masked or slots[-1] >= S:  # the last chunk ends with the last block, past slot S - 1
            hidden = (slots >= visible[..., None]).transpose(1, 2)[..., None]  # [B, n, T, 1]
            s.view(B, -1, T, h).masked_fill_(hidden, float("-inf"))
        m_new = torch.maximum(m, _amax_over_keys(s))
        m_safe = m_new.clamp_min(torch.finfo(acc).min)  # no key seen yet: keep exp(-inf - m) = 0
        alpha = torch.exp(m - m_safe)  # [B, 1, T h]
        p = s.sub_(m_safe).exp_()
        l.mul_(alpha[:, 0]).add_(p.sum(dim=1))
        o.mul_(alpha.transpose(1, 2)).add_(torch.bmm(cast(p, q_lat.dtype).transpose(1, 2), values)[..., :d_c])
        m = m_new
    # l >= 1 wherever a key is visible (the max contributes exp(0)), 0 where none is.
    out = cast(o.div_(l.clamp_min(1.0)[..., None]), q_lat.dtype).view(B, T, h, d_c)
    lse = (m[:, 0] + torch.log(l)).view(B, T, h)  # -inf where no key is visible
    return out, lse.to(lse_dtype(q_lat))


def check_paged_reach(kv_cache: torch.Tensor, block_table: Optional[torch.Tensor], cache_seqlens: torch.Tensor,
                      max_seqlen: Optional[int]) -> int:
    """S, the longest length, once the cache is known to hold it: every length within the
    capacity and, when paged, the first blocks it needs inside the pool. Raises ValueError."""
    S = int(cache_seqlens.max()) if max_seqlen is None else max_seqlen
    capacity = kv_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    if S > capacity or (max_seqlen is None and int(cache_seqlens.min()) < 0):
        # Past the capacity the slice would silently hold fewer slots than the lengths claim.
        raise ValueError(f"cache_seqlens: expected lengths in [0, {capacity}] (the cache's capacity), got "
                         f"{cache_seqlens.tolist()}")
    if block_table is not None and S > 0:
        _check_block_table(kv_cache, block_table, S)
    return S


def torch_mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                     block_table: Optional[torch.Tensor], cache_seqlens: torch.Tensor,
                     scale_cache: Optional[torch.Tensor] = None, softmax_scale: float = 1.0, *,
                     mode: str = "blockwise", visible_lens: Optional[torch.Tensor] = None,
                     max_seqlen: Optional[int] = None, rows: Optional[DenseRows] = None,
                     indices: Optional[torch.Tensor] = None,
                     topk_length: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's torch backend; arguments as ``mla_decode_with_kvcache`` (already checked), ``rows`` the
    row format (None: dense).

    Returns (out [B, S_q, H, d_c] in q_lat's dtype, lse [B, S_q, H] float32 (float64 for float64 queries)).
    """
    S_q = q_lat.shape[1]
    rows = rows if rows is not None else row_format("dense", q_lat.shape[-1], q_rope.shape[-1])
    S = check_paged_reach(kv_cache, block_table, cache_seqlens, max_seqlen)
    if S == 0:  # nothing cached anywhere: no visible slot, out = 0 and lse = -inf
        return torch.zeros_like(q_lat), q_lat.new_full(q_lat.shape[:3], float("-inf"), dtype=lse_dtype(q_lat))
    if recording(q_lat, q_rope, kv_cache, scale_cache):  # the paths below work in place: autograd cannot follow
        return differentiable_decode(q_lat, q_rope, kv_cache, block_table, cache_seqlens, scale_cache, softmax_scale,
                                     mode, visible_lens, S, rows, indices, topk_length)
    if indices is not None:
        return _sparse_attend(q_lat, q_rope, kv_cache, scale_cache, block_table, cache_seqlens, indices, topk_length,
                              softmax_scale, mode, rows)
    visible = default_visible_lens(cache_seqlens, S_q) if visible_lens is None else visible_lens
    if block_table is not None:
        return _paged_attend(q_lat, q_rope, kv_cache, scale_cache, block_table, S, visible, cache_seqlens,
                             softmax_scale, mode, rows)
    latent = kv_cache[:, :S]  # a contiguous cache: its first S slots, no copy
    key_scale = scale_cache[:, :S] if scale_cache is not None else None
    return _attend_visible(q_lat, q_rope, latent, key_scale, visible, cache_seqlens, softmax_scale, mode, rows)


def _attend_visible(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, key_scale: Optional[torch.Tensor],
                    visible: torch.Tensor, lengths: torch.Tensor, softmax_scale: float, mode: str,
                    rows: DenseRows) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`latent_attention` over S slots, latent [B, S, width] and key_scale [B, S, G], where
    query t of sequence b sees its first visible[b, t] slots and sequence b has filled
    lengths[b] of them. Returns (out [B, T, h, d_c], lse [B, T, h] float32 (float64 for float64 queries))."""
    S = latent.shape[1]
    visible = torch.minimum(visible.long(), lengths.long()[:, None])
    mask = None
    if not bool((visible >= S).all()):  # the steady state of batched decoding needs no mask
        mask = torch.arange(S, device=q_lat.device) < visible[..., None]  # [B, T, S]
        shorter = torch.arange(S, device=q_lat.device) >= lengths[:, None]  # [B, S]
        if bool(shorter.any()):
            # Slots past a shorter sequence's length may hold anything (NaN, stale rows), and
            # a softmax weight of 0 times NaN is still NaN in p @ c: zero them first (zero
            # bytes read as 0 in every quantized format too).
            latent = latent.masked_fill(shorter[..., None], 0)
            if key_scale is not None:
                key_scale = key_scale.masked_fill(shorter[..., None], 0)
    out, lse = latent_attention(q_lat, q_rope, latent, key_scale, softmax_scale, mask, mode, return_lse=True,
                                kv_format=rows)
    return out, lse.to(lse_dtype(q_lat))


def _gather_rows(table: torch.Tensor, block_table: Optional[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The rows of ``slots`` [B, n] (slot j of sequence b: block block_table[b, j // block_size],
    row j % block_size; without a block table, row j of sequence b) from table [num_blocks or B,
    block_size, width], as [B, n, width] in one ``index_select`` over the flattened rows where the
    table's strides allow it (a column view of wider rows included; advanced indexing otherwise,
    several times slower on the CPU measured)."""
    B, n = slots.shape
    page = table.shape[1]
    blocks = torch.arange(B, device=slots.device)[:, None] if block_table is None else \
        block_table.long().gather(1, slots // page)
    if table.stride(0) == page * table.stride(1):  # [num_blocks * block_size, width] is a view
        rows = table.view(-1, table.shape[-1]).index_select(0, (blocks * page + slots % page).view(-1))
        return rows.view(B, n, -1)
    return table[blocks.expand(B, n), slots % page]


def _sparse_attend(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                   scale_cache: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                   cache_seqlens: torch.Tensor, indices: torch.Tensor, topk_length: Optional[torch.Tensor],
                   softmax_scale: float, mode: str, rows: DenseRows) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse decode: each query's selected slots, packed to the front (``selection.py``), are
    gathered, rows and key scalars with the same indices, into a cache of their own, [B S_q, topk,
    width], one block per query, and each query attends to its first count rows through
    :func:`_paged_attend`, as a dense paged decode of B S_q one-token sequences whose lengths are
    the counts (its two contiguous GEMM operands, its masking of the rows past a length). A
    top-k decode reads topk rows per query token whatever the context's length, so the gathered
    copy is small (topk 2048 at d_c 512, d_r 64 in bfloat16: 2.4 MB per query token); quantized
    rows are gathered as bytes.

    kv_cache [num_blocks, block_size, width] with block_table [B, max_blocks], or [B, capacity,
    width] with None; indices [B, S_q, topk]; topk_length [B] or None. Returns (out [B, S_q, h,
    d_c], lse [B, S_q, h] float32, float64 for float64 queries; out 0 and lse -inf for a query that selects
    nothing)."""
    B, T, h, d_c = q_lat.shape
    slots, counts = packed_selection(indices, topk_length, cache_seqlens)  # [B, T, topk], [B, T]
    topk = slots.shape[-1]
    # Queries in groups of at most GATHER_ROWS gathered rows: each query's softmax is its own, so
    # the groups are independent, and the copy stays bounded however many queries a call brings.
    per_group = max(1, GATHER_ROWS // (B * topk))
    if per_group >= T:
        return _sparse_group(q_lat, q_rope, kv_cache, scale_cache, block_table, slots, counts, softmax_scale, mode,
                             rows)
    out, lse = torch.empty_like(q_lat), q_lat.new_empty((B, T, h), dtype=lse_dtype(q_lat))
    for t in range(0, T, per_group):
        group = slice(t, min(t + per_group, T))
        out[:, group], lse[:, group] = _sparse_group(q_lat[:, group], q_rope[:, group], kv_cache, scale_cache,
                                                     block_table, slots[:, group], counts[:, group], softmax_scale,
                                                     mode, rows)
    return out, lse


def _sparse_group(q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                  scale_cache: Optional[torch.Tensor], block_table: Optional[torch.Tensor], slots: torch.Tensor,
                  counts: torch.Tensor, softmax_scale: float, mode: str,
                  rows: DenseRows) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_sparse_attend` for queries q_lat [B, T, h, d_c] whose packed selections are slots
    [B, T, topk] with counts [B, T]: their rows gathered, then attended. -> (out, lse) as there."""
    B, T, h, d_c = q_lat.shape
    topk = slots.shape[-1]
    slots = slots.reshape(B, T * topk)
    pool = _gather_rows(kv_cache, block_table, slots).view(B * T, topk, -1)
    scale_pool = None if scale_cache is None else _gather_rows(scale_cache, block_table, slots).view(B * T, topk, -1)
    counts = counts.reshape(B * T)
    longest = int(counts.max())  # read once: on a GPU each read is a sync
    one_block_each = torch.arange(B * T, device=q_lat.device)[:, None]
    out, lse = _paged_attend(q_lat.reshape(B * T, 1, h, d_c), q_rope.reshape(B * T, 1, h, -1), pool, scale_pool,
                             one_block_each, longest, counts[:, None], counts, softmax_scale, mode, rows)
    return out.view(B, T, h, d_c), lse.view(B, T, h)
