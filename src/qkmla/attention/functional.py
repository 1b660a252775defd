"""Attention arithmetic shared by the modules: SDPA over materialized keys, and the
absorbed latent attention (the torch decode path, written to be read).

Shapes follow [B, T, H, D]: B sequences, T query tokens, S cached tokens, h query heads,
G KV groups (head i reads group i // (h / G)).
"""

from __future__ import annotations

import time
from typing import Optional, Union

import torch
import torch.nn.functional as F

from ..dtypes import accumulate_dtype, cast

Scale = Union[float, torch.Tensor]  # a float, or one value per head [h]

# SDPA broadcasts KV groups itself from PyTorch 2.5 on; older versions get repeated keys.
_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def check_hidden(x: torch.Tensor, hidden_size: int, dtype: torch.dtype) -> None:
    """x must be [B, T, hidden_size] in the module's dtype."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor of shape [batch, seq, {hidden_size}], got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != hidden_size or x.shape[1] == 0:
        raise ValueError(f"x: expected shape [batch, seq >= 1, hidden_size={hidden_size}], got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"x: dtype {x.dtype} does not match the module's parameters ({dtype}); "
                         f"pass x.to({dtype}) or call module.to(dtype)")


def default_positions(x: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, T] positions: 0..T-1 when none are given; a [T] tensor is broadcast."""
    B, T = x.shape[:2]
    if positions is None:
        return torch.arange(T, device=x.device).expand(B, T)
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions: expected an integer tensor of shape [{B}, {T}] or [{T}], got {positions!r:.80}")
    if positions.shape == (T,):
        positions = positions.expand(B, T)
    if positions.shape != (B, T):
        raise ValueError(f"positions: expected shape [{B}, {T}] or [{T}], got {tuple(positions.shape)}")
    if bool((positions < 0).any()):
        raise ValueError("positions: expected non-negative positions")
    return positions.to(x.device)


def per_head(scale: Scale, ndim_after: int) -> Scale:
    """Broadcast a per-head scale [h] over ``ndim_after`` trailing dims."""
    if isinstance(scale, torch.Tensor):
        return scale.view(scale.shape + (1,) * ndim_after)
    return scale


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Scale,
         mask: Optional[torch.Tensor] = None, causal: bool = False) -> torch.Tensor:
    """One ``scaled_dot_product_attention`` call over materialized keys.

    Args:
        q: [B, T, h, D]; k: [B, S, G, D]; v: [B, S, G, Dv]; G divides h.
        scale: logit scale, a float or [h] (then folded into q).
        mask: [B, T, S] bool, True where a key is visible; rows with no visible key give 0.
        causal: plain causal masking with T == S (no mask).

    Returns:
        [B, T, h, Dv]
    """
    h, G = q.shape[2], k.shape[2]
    if isinstance(scale, torch.Tensor):
        q, scale = q * per_head(scale, 1).to(q.dtype), 1.0
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    kwargs = {}
    if G != h:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(h // G, dim=1) for t in (k, v))
    attn_mask = mask[:, None] if mask is not None else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal and mask is None,
                                         scale=scale, **kwargs)
    out = out.transpose(1, 2)  # [B, T, h, Dv]
    if mask is not None:
        out = out.masked_fill(~mask.any(-1)[:, :, None, None], 0.0)
    return out


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, scale: Scale, chunk: int = 256) -> torch.Tensor:
    """Per-head max causal pre-softmax logit [h], in chunks of ``chunk`` queries.

    Never holds more than [B, h, chunk, S] logits at once, so measuring does not
    materialize the full attention matrix.

    Args:
        q: [B, T, h, D]; k: [B, T, G, D] (keys of the same T tokens, causal); scale: float or [h].
    """
    B, T, h, _ = q.shape
    G = k.shape[2]
    acc = accumulate_dtype(q.dtype)
    kk = k.repeat_interleave(h // G, dim=2).transpose(1, 2).to(acc)  # [B, h, T, D]
    qq = (q.to(acc) * per_head(scale, 1)).transpose(1, 2)  # [B, h, T, D]
    best = torch.full((h,), float("-inf"), dtype=acc, device=q.device)
    for start in range(0, T, chunk):
        stop = min(T, start + chunk)
        s = qq[:, :, start:stop] @ kk[:, :, :stop].transpose(-1, -2)  # [B, h, c, stop]
        causal = torch.arange(stop, device=q.device) <= torch.arange(start, stop, device=q.device)[:, None]
        s = s.masked_fill(~causal, float("-inf"))
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best


def record_max_logits(module, q: torch.Tensor, k: torch.Tensor) -> None:
    """Store ``module``'s per-head max logits of this forward and the seconds measuring took
    (``last_max_logits`` [h], ``max_logit_seconds``), for QK-Clip and diagnostics."""
    t0 = time.perf_counter()
    scale = module.scale.detach() if isinstance(module.scale, torch.Tensor) else module.scale
    module.last_max_logits = max_logits(q, k, scale)
    module.max_logit_seconds = time.perf_counter() - t0


SCORE_CHUNK = 4096  # keys per score GEMM: 4096 fp32 rows of d_c + d_r = 576 are 9.4 MB


def _key_major_scores(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                      inv_rms: Optional[torch.Tensor], mode: str) -> torch.Tensor:
    """Logits laid out key-major, [B, S, T, h].

    Key-major is the faster orientation for BLAS: latent [S, d] @ q^T [d, T h] streams the
    cache row by row (on a 2-core AVX2 CPU, 3.5 ms vs 6.1 ms for q @ latent^T at S = 16k).
    The keys go in chunks of about SCORE_CHUNK that fit in the last-level cache: with a blockwise
    QK norm the content (K = d_c) and RoPE (K = d_r) GEMMs read the same rows, and the
    second finds them there instead of in DRAM; plain MLA's single GEMM is chunked alike,
    so the two paths compare like with like. Unified mode scales the whole logit, so it
    needs plain MLA's one GEMM and a multiply.
    """
    B, T, h, d_c = q_lat.shape
    S = latent.shape[1]
    acc = accumulate_dtype(q_lat.dtype)
    latent = cast(latent, q_lat.dtype)
    split = inv_rms is not None and mode == "blockwise"
    if split:  # r scales only the content score
        q_c_t = q_lat.reshape(B, T * h, d_c).transpose(1, 2)
        q_r_t = q_rope.reshape(B, T * h, -1).transpose(1, 2)
        content, rope = latent[..., :d_c], latent[..., d_c:]
    else:
        q_t = torch.cat((q_lat, q_rope), dim=-1).reshape(B, T * h, -1).transpose(1, 2)
    if inv_rms is not None:
        G = inv_rms.shape[-1]
        # [B, S, G] -> broadcastable against a chunk's [B, n, T, G, h/G] logits; with one
        # query token and one head per group the GEMM output [B, n, h] already lines up.
        by_head = T == 1 and G == h
        r = cast(inv_rms, acc)
        r = r if by_head else r[:, :, None, :, None]

    def grouped(s: torch.Tensor) -> torch.Tensor:
        return s if by_head else s.view(B, -1, T, G, h // G)

    # Equal chunks of about SCORE_CHUNK keys: a context of 4096 k + 1 tokens should not
    # pay a whole chunk's worth of calls for its last key. Every chunk's GEMM writes straight
    # into one logit buffer: a list of chunk outputs joined by torch.cat would allocate and
    # copy the logits a second time (at 16k keys a fresh MB, page faults included).
    n_chunks = max(1, round(S / SCORE_CHUNK))
    size = max(1, -(-S // n_chunks))
    s = torch.empty(B, S, T * h, dtype=acc, device=q_lat.device)
    for start in range(0, S, size):
        stop = start + size
        s_chunk = s[:, start:stop]
        if not split:
            _bmm_into(s_chunk, latent[:, start:stop], q_t)
            if inv_rms is not None:  # unified: s = r[j, g] * (q_lat . c_j + q_rope . k_rope_j)
                grouped(s_chunk).mul_(r[:, start:stop])
            continue
        # r scales the content score before the RoPE score joins, both in place: the RoPE
        # GEMM accumulates into the content GEMM's output (beta = 1).
        _bmm_into(s_chunk, content[:, start:stop], q_c_t)
        grouped(s_chunk).mul_(r[:, start:stop])
        if s.dtype == rope.dtype:
            s_chunk.baddbmm_(rope[:, start:stop], q_r_t)
        else:  # a half-precision GEMM, summed in float32
            s_chunk.add_(torch.bmm(rope[:, start:stop], q_r_t))
    return s.view(B, S, T, h)


def _amax_over_keys(s: torch.Tensor) -> torch.Tensor:
    """max over dim 1 of s [B, S, N], as [B, 1, N].

    Reduced directly, the CPU kernel is slow when the rows are short: 814 us for
    [1, 16384, 16] against 28 us for the same values as [1, 1024, 256] (2-core AVX2).
    So k consecutive key rows are first folded into one row of k N values (a view), and the
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
                  inv_rms: Optional[torch.Tensor], mode: str = "blockwise") -> torch.Tensor:
    """Pre-softmax logits of the absorbed path (queries already carry the logit scale).

    The content score is the raw latent dot product scaled by the key's group scalar r
    (the query's scalar is already in q_lat), MATH.md S^C[i, j] = rho_q[i] (Q_lat C^T)[i, j] r[j, g(i)]:

        blockwise: s = r[j, g] * (q_lat . c_j) + q_rope . k_rope_j
        unified:   s = r[j, g] * (q_lat . c_j + q_rope . k_rope_j)
        plain:     s = [q_lat, q_rope] . latent_j              (one GEMM over d_c + d_r)

    Args:
        q_lat: [B, T, h, d_c]; q_rope: [B, T, h, d_r];
        latent: [B, S, d_c + d_r] = [c ; k_rope]; inv_rms: [B, S, G] or None.

    Returns:
        [B, T, h, S] in at least float32 (a permuted view).
    """
    return _key_major_scores(q_lat, q_rope, latent, inv_rms, mode).permute(0, 2, 3, 1)


def latent_attention(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                     inv_rms: Optional[torch.Tensor], scale: Scale, mask: Optional[torch.Tensor] = None,
                     mode: str = "blockwise", return_lse: bool = False):
    """Absorbed MLA attention over a latent cache (the torch path).

    Args:
        q_lat: [B, T, h, d_c] latent queries (query scalar and both norm weights folded in).
        q_rope: [B, T, h, d_r] normalized, rotated RoPE queries.
        latent: [B, S, d_c + d_r] cached [c ; k_rope].
        inv_rms: [B, S, G] key scalars, or None for plain MLA.
        scale: logit scale, float or [h]; folded into the queries (O(h d) work, not O(h S)).
        mask: [B, T, S] bool or None; rows with no visible key give 0.
        mode: "blockwise" or "unified".

    Returns:
        o_lat [B, T, h, d_c] = softmax(s) @ c, and with ``return_lse`` the log-sum-exp
        [B, T, h] (float32) of the scaled logits, so W_UV can be applied afterwards.
    """
    B, T, h, d_c = q_lat.shape
    q_scale = per_head(scale, 1)
    if isinstance(q_scale, torch.Tensor):
        q_scale = cast(q_scale, q_lat.dtype)
    s = _key_major_scores(q_lat * q_scale, q_rope * q_scale, latent, inv_rms, mode)  # [B, S, T, h]
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
    c = cast(latent[..., :d_c], q_lat.dtype)
    # c^T [d_c, S] @ p [S, T h]: the cache-streaming orientation again.
    o = torch.bmm(c.transpose(1, 2), cast(p, q_lat.dtype).view(B, S, T * h))  # [B, d_c, T h]
    o.div_(denom.view(B, 1, T * h))
    o_lat = o.transpose(1, 2).reshape(B, T, h, d_c)
    if return_lse:
        lse = m.squeeze(1) + torch.log(row_sum)  # [B, T, h]; -inf where no key is visible
    return (o_lat, lse) if return_lse else o_lat
