"""``qkmla verify``'s quantized-cache rows: what still holds exactly over a quantized latent.

A quantized cache (``kv_format`` "fp8", "int8", "int4"; ``qkmla.kv_formats``) changes the
latent the decoder reads, c -> c^ = dequantize(quantize(c)), and rounds the stored RoPE key
to bfloat16. Each token's key scalar r is computed from c^ (``LatentCache.stored_latent``),
so every cached key is the normalized key of c^, and the Appendix E identity carries over:

* exactness (float64): the absorbed path over the quantized cache (the decode op reading the
  bytes; logits from the dequantized rows) equals the explicit path with every key
  materialized from the stored row (c^ W_UK, normalized by the key norm itself; the stored
  RoPE key; no cached scalar used) to roundoff: max |difference| <= 1e-10 x the largest
  logit / output. In unified mode the statistic's RoPE part is the RoPE key before its
  bfloat16 rounding, as the cache writer has it.
* quantization error: the absorbed output over the quantized cache against the explicit
  path over the unquantized layer (float64), ||difference|| / ||output|| over all outputs,
  at most :data:`OUTPUT_ERROR_BOUND` of the format (about 3x the largest value seen over
  seeds 0-4: fp8 0.042, int8 0.012, int4 0.181; a bound, not a target: the quality of a
  format is judged on trained models).

:func:`key_scalar_choice` measures the alternative, r from the full-precision c: the
output error against the unquantized cache with each choice (docs/cache.md, "The key scalar
is computed from the stored latent").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.absorbed import values_out
from ..attention.functional import default_positions, sdpa
from ..attention.mla import MLA
from ..cache.latent import LatentCache
from ..config import MLAConfig
from ..ops.mla_decode import mla_decode_with_kvcache
from ..ops.mla_decode.torch_impl import latent_scores
from .verify import BASE, VARIANTS, _max_abs, _max_finite, random_mla

FORMATS = ("fp8", "int8", "int4")
QUANT_VARIANTS = ("rms-blockwise", "rms-unified", "l2", "lp-3", "none", "rms-gqa-G2")
FLOAT64_RTOL = 1e-10
OUTPUT_ERROR_BOUND = {"fp8": 0.125, "int8": 0.035, "int4": 0.55}


@dataclass
class QuantRow:
    variant: str
    kv_format: str
    max_abs_logit_diff: float  # absorbed over the quantized cache vs explicit over the stored rows
    max_abs_output_diff: float
    tolerance: float  # FLOAT64_RTOL x max |logit|
    output_tolerance: float
    quant_output_err: float  # ||absorbed, quantized - explicit, unquantized|| / ||explicit, unquantized||
    quant_bound: float
    ok: bool


def explicit_over_stored(mla: MLA, x: torch.Tensor, cache: LatentCache) -> dict[str, torch.Tensor]:
    """Logits [B, h, T, T] and outputs [B, T, d] of the explicit path over the rows ``cache``
    holds for x's T tokens: keys and values materialized from the stored latent c^ with
    ``kv_b_proj``, the key norm applied to them, the stored RoPE key; the cached scalars unused."""
    c = mla.config
    B, T = x.shape[:2]
    positions = default_positions(x, None)
    latent, _ = cache.load()  # [B, T, d_c + d_r], dequantized
    c_hat, k_rope = latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    k_c, v = mla.kv_b_proj(c_hat).view(B, T, c.num_kv_groups, -1).split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k_r = k_rope[:, :, None].expand(B, T, c.num_kv_groups, c.qk_rope_head_dim)
    if mla.k_norm is not None and mla.k_norm.mode == "blockwise":
        k_c = mla.k_norm.content(k_c)  # the stored RoPE key is already normalized
    elif mla.k_norm is not None:  # one statistic over [k^C ; k~^R], k~^R as the writer had it
        sigma, _ = mla.k_norm.statistics(k_c, mla.latent(x)[1])
        k_c, k_r = mla.k_norm.content.scaled(k_c, sigma), k_r * sigma
    k = torch.cat((k_c, k_r), dim=-1)
    q = mla.explicit_query(x, positions)
    s = torch.einsum("bthd,bshd->bths", q, k.repeat_interleave(c.heads_per_group, dim=2))
    s = s * (mla.scale[:, None] if isinstance(mla.scale, torch.Tensor) else mla.scale)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    logits = s.masked_fill(~causal[:, None, :], float("-inf")).transpose(1, 2)
    return {"logits": logits, "out": mla.o_proj(sdpa(q, k, v, mla.scale, causal=True).flatten(2))}


def absorbed_over_quantized(mla: MLA, x: torch.Tensor, kv_format: str) -> tuple[dict, LatentCache]:
    """Logits (absorbed form over the dequantized rows, with the cached scalars) and outputs
    (``mla(x, cache, path="absorbed")``: the decode op reads the bytes) over a fresh
    ``kv_format`` cache of x's tokens; and the cache."""
    B, T = x.shape[:2]
    cache = LatentCache.from_config(mla.config, B, T, dtype=x.dtype, kv_format=kv_format, fill=float("nan"))
    out = mla(x, cache, path="absorbed")
    q_lat, q_rope = mla.absorbed_query(x, default_positions(x, None))
    s = latent_scores(q_lat, q_rope, *cache.load(), mla.score_mode)
    s = s * (mla.scale[:, None] if isinstance(mla.scale, torch.Tensor) else mla.scale)
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    return {"logits": s.masked_fill(~causal[:, None, :], float("-inf")).transpose(1, 2), "out": out}, cache


def verify_quantized(name: str, kv_format: str, seed: int = 0, batch: int = 2, seq: int = 33) -> QuantRow:
    """One row: ``VARIANTS[name]`` (float64) over a ``kv_format`` cache."""
    mla = random_mla(BASE.replace(**VARIANTS[name]), seed).eval()
    torch.manual_seed(seed + 1)
    x = torch.randn(batch, seq, mla.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        absorbed, cache = absorbed_over_quantized(mla, x, kv_format)
        explicit = explicit_over_stored(mla, x, cache)
        dense = mla(x)
    logit_mag, out_mag = _max_finite(explicit["logits"]), _max_finite(explicit["out"])
    d_l, d_o = _max_abs(absorbed["logits"], explicit["logits"]), _max_abs(absorbed["out"], explicit["out"])
    err = float((absorbed["out"] - dense).norm() / dense.norm())
    tol, out_tol, bound = FLOAT64_RTOL * logit_mag, FLOAT64_RTOL * out_mag, OUTPUT_ERROR_BOUND[kv_format]
    return QuantRow(name, kv_format, d_l, d_o, tol, out_tol, err, bound, d_l <= tol and d_o <= out_tol and err <= bound)


def run(formats=FORMATS, seed: int = 0) -> list[QuantRow]:
    return [verify_quantized(name, f, seed) for f in formats for name in QUANT_VARIANTS]


def format_rows(rows: list[QuantRow]) -> str:
    lines = [f"{'variant':<15}{'kv_format':<10}{'|A-E| logit':>12}{'|A-E| out':>11}{'tolerance':>11}"
             f"{'quant err':>11}{'bound':>8}  ok"]
    for r in rows:
        lines.append(f"{r.variant:<15}{r.kv_format:<10}{r.max_abs_logit_diff:>12.2e}{r.max_abs_output_diff:>11.2e}"
                     f"{r.tolerance:>11.2e}{r.quant_output_err:>11.2e}{r.quant_bound:>8.3f}  {'ok' if r.ok else 'FAIL'}")
    lines.append("Quantized cache, float64: absorbed over the quantized cache (A) == explicit over the stored rows "
                 "(E: keys from the dequantized latent, normalized by the key norm, stored RoPE key) to <= 1e-10 x "
                 "max|logit| (and outputs); quant err = ||A - unquantized explicit|| / ||unquantized|| over all outputs <= bound.")
    return "\n".join(lines)


# -- the key scalar's source: r from the stored latent (chosen) or from the full-precision c --


KEY_SCALAR_CONFIG = MLAConfig(hidden_size=512, num_heads=16, num_kv_groups=16, q_lora_rank=256, kv_lora_rank=512,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, qk_norm="rms")


def _decode_last(mla: MLA, x: torch.Tensor, cache: LatentCache, queries: int) -> torch.Tensor:
    """Outputs [B, queries, d] of x's last ``queries`` tokens attending over ``cache``, which
    holds all of x (each query sees the tokens up to itself): the absorbed path's last step."""
    T = x.shape[1]
    positions = torch.arange(T - queries, T).expand(x.shape[0], queries)
    q_lat, q_rope = mla.absorbed_query(x[:, -queries:], positions)
    o_lat, _ = mla_decode_with_kvcache(q_lat, q_rope, **cache.decode_view(), softmax_scale=mla.scale,
                                       mode=mla.score_mode, backend="torch")
    return mla.o_proj(values_out(o_lat, mla.absorbed).flatten(2))


def key_scalar_choice(kv_format: str, length: int, logit_scale: float = 1.0, seed: int = 0,
                      queries: int = 16) -> dict[str, float]:
    """Relative output error ||y - y_dense|| / ||y_dense|| of the last ``queries`` tokens of a
    random QK-normed layer (DeepSeek-V3 widths at TP=8, float64, tau x ``logit_scale``) over a
    ``kv_format`` cache of ``length`` tokens, with each token's key scalar r computed from the
    stored latent ("stored", what the cache does) or from the full-precision one ("full")."""
    config = KEY_SCALAR_CONFIG.replace(softmax_scale=KEY_SCALAR_CONFIG.scale * logit_scale)
    mla = random_mla(config, seed).eval()
    torch.manual_seed(seed + 1)
    x = torch.randn(1, length, config.hidden_size, dtype=torch.float64)
    positions = default_positions(x, None)
    outs = {}
    with torch.no_grad():
        for how, fmt in (("dense", "dense"), ("stored", kv_format), ("full", kv_format)):
            cache = LatentCache.from_config(config, 1, length, dtype=torch.float64, kv_format=fmt)
            rows = mla.cache_rows(x, positions, cache=cache if how == "stored" else None)
            cache.append(cache.plan(1, length), **rows)
            outs[how] = _decode_last(mla, x, cache, queries)
    ref = outs["dense"].norm()
    return {how: float((outs[how] - outs["dense"]).norm() / ref) for how in ("stored", "full")}
