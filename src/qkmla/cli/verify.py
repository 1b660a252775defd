"""The paper's Appendix E test: explicit and absorbed paths agree, for every norm variant.

For each variant, a random MLA layer (random norm weights too, so absorbing gamma is
exercised) and random inputs are run through

* the explicit path: materialize keys, normalize, dot (logits) / one SDPA call (outputs);
* the absorbed path: write the latent cache, latent dot products scaled by the scalars
  (logits) / absorbed attention and W_UV (outputs);

in float64, float32 and bfloat16. Tolerances:

* float64: max |explicit - absorbed| <= 1e-10 relative to the largest reference value.

The ``*-yarn`` rows use DeepSeek's YaRN RoPE (MATH.md "RoPE and YaRN") at positions past its
original context, so the absorbed path must apply the same cos/sin factor and corrected tau.
* float32 / bfloat16 (FlashAttention's rule): the absorbed path's error against the
  float64 explicit reference is at most twice the explicit path's own error in that
  dtype, plus one unit of roundoff of that dtype at the reference's largest magnitude.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..attention.mla import MLA
from ..cache.latent import LatentCache
from ..config import MLAConfig, QKNormConfig
from ..norms import ScalarNorm

BASE = MLAConfig(hidden_size=96, num_heads=8, num_kv_groups=8, q_lora_rank=48, kv_lora_rank=64,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)

# Unit-Lp vectors have small dot products (entries ~ n^(-1/p)), so the L2/Lp rows use a
# larger logit scale, as Henry et al.'s learned g would be, to test at useful logit sizes.
VARIANTS: dict[str, dict] = {
    "rms-blockwise": dict(qk_norm="rms"),
    "rms-unified": dict(qk_norm=QKNormConfig("rms", mode="unified")),
    "l2": dict(qk_norm=QKNormConfig("l2", learnable_logit_scale=True), softmax_scale=20.0),
    "lp-1": dict(qk_norm=QKNormConfig("lp", p=1.0), softmax_scale=1000.0),
    "lp-1.5": dict(qk_norm=QKNormConfig("lp", p=1.5), softmax_scale=100.0),
    "lp-3": dict(qk_norm=QKNormConfig("lp", p=3.0), softmax_scale=10.0),
    "lp-4": dict(qk_norm=QKNormConfig("lp", p=4.0), softmax_scale=5.0),
    "lp-3-unified": dict(qk_norm=QKNormConfig("lp", mode="unified", p=3.0), softmax_scale=10.0),
    "rms-content": dict(qk_norm=QKNormConfig("rms", mode="content")),
    "rms-content-G2": dict(qk_norm=QKNormConfig("rms", mode="content"), num_kv_groups=2),
    # one statistic per token over all heads (OLMoE's norm), weights per head: one cached key scalar
    "rms-projection-G2": dict(qk_norm=QKNormConfig("rms", scope="projection"), num_kv_groups=2),
    "rms-content-projection-G2": dict(qk_norm=QKNormConfig("rms", mode="content", scope="projection"),
                                      num_kv_groups=2),
    "lp-3-unified-projection": dict(qk_norm=QKNormConfig("lp", mode="unified", p=3.0, scope="projection"),
                                    softmax_scale=10.0),
    "none": dict(qk_norm=None),
    "rms-gqa-G2": dict(qk_norm="rms", num_kv_groups=2),
    "rms-mqa-G1": dict(qk_norm="rms", num_kv_groups=1),
    "rms-no-q-lora": dict(qk_norm="rms", q_lora_rank=None),
    # DeepSeek's YaRN with L0 = 8, so most of the 33 positions lie past it; mscale != mscale_all_dim
    # scales the cos/sin tables (x 0.9507) as well as tau (x 1.2651), and both paths must see both.
    "rms-yarn": dict(qk_norm="rms", rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                                                      mscale=0.5, mscale_all_dim=0.9)),
    "none-yarn": dict(qk_norm=None, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8,
                                                      mscale=0.5, mscale_all_dim=0.9)),
    "rms-odd-sizes": dict(qk_norm="rms", hidden_size=37, num_heads=6, num_kv_groups=3, q_lora_rank=19,
                          kv_lora_rank=23, qk_nope_head_dim=13, qk_rope_head_dim=6, v_head_dim=11),
}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
FLOAT64_RTOL = 1e-10


@dataclass
class Row:
    variant: str
    dtype: str
    max_abs_logit_diff: float  # max |explicit - absorbed| in this dtype
    max_abs_output_diff: float
    explicit_logit_err: float  # max |explicit(dtype) - explicit(float64)|
    absorbed_logit_err: float
    explicit_output_err: float
    absorbed_output_err: float
    tolerance: float  # bound on the logit quantity the dtype is judged by (see module docstring)
    output_tolerance: float
    max_abs_logit: float  # largest finite reference logit / output, the scale of "relative"
    max_abs_output: float
    ok: bool


def perturb_vectors(module: torch.nn.Module, scale: float = 0.3) -> torch.nn.Module:
    """Move every 1-D parameter (norm weights, logit scales) and every QK-norm weight (a row per
    head with the projection scope) randomly away from its initial value, so that folding them
    into other weights is actually exercised."""
    norm_weights = {id(m.weight) for m in module.modules() if isinstance(m, ScalarNorm)}
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() == 1 or id(p) in norm_weights:
                p.mul_(1 + scale * torch.randn_like(p))
    return module


def random_mla(config: MLAConfig, seed: int) -> MLA:
    """An MLA layer in float64 with every weight random, norm weights around 1."""
    torch.manual_seed(seed)
    return perturb_vectors(MLA(config).double())


def paths(mla: MLA, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Logits and outputs of both paths for one chunk x [B, T, d] (tokens at 0..T-1)."""
    B, T = x.shape[:2]
    cache = LatentCache.from_config(mla.config, B, T, dtype=x.dtype, device=x.device)
    with torch.no_grad():
        return {
            "logit_explicit": mla.logits(x, "explicit"),
            "logit_absorbed": mla.logits(x, "absorbed"),
            "out_explicit": mla(x),
            "out_absorbed": mla(x, cache, path="absorbed"),
        }


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a.double() - b.double()).abs()
    return float(d.nan_to_num(0.0, posinf=0.0, neginf=0.0).max())  # -inf - -inf on masked entries


def _max_finite(a: torch.Tensor) -> float:
    return float(a.double().nan_to_num(0.0, posinf=0.0, neginf=0.0).abs().max())


def verify_variant(name: str, overrides: dict, seed: int = 0, batch: int = 2, seq: int = 33) -> list[Row]:
    config = BASE.replace(**overrides)
    mla64 = random_mla(config, seed)
    torch.manual_seed(seed + 1)
    x64 = torch.randn(batch, seq, config.hidden_size, dtype=torch.float64)
    ref = paths(mla64, x64)
    logit_mag, out_mag = _max_finite(ref["logit_explicit"]), _max_finite(ref["out_explicit"])
    rows = []
    for dname, dtype in DTYPES.items():
        r = ref if dtype == torch.float64 else paths(copy.deepcopy(mla64).to(dtype), x64.to(dtype))
        e_l, a_l = _max_abs(r["logit_explicit"], ref["logit_explicit"]), _max_abs(r["logit_absorbed"], ref["logit_explicit"])
        e_o, a_o = _max_abs(r["out_explicit"], ref["out_explicit"]), _max_abs(r["out_absorbed"], ref["out_explicit"])
        d_l, d_o = _max_abs(r["logit_explicit"], r["logit_absorbed"]), _max_abs(r["out_explicit"], r["out_absorbed"])
        if dtype == torch.float64:
            tol, out_tol = FLOAT64_RTOL * logit_mag, FLOAT64_RTOL * out_mag
            ok = d_l <= tol and d_o <= out_tol
        else:
            eps = torch.finfo(dtype).eps
            tol, out_tol = 2 * e_l + eps * logit_mag, 2 * e_o + eps * out_mag
            ok = a_l <= tol and a_o <= out_tol
        rows.append(Row(name, dname, d_l, d_o, e_l, a_l, e_o, a_o, tol, out_tol, logit_mag, out_mag, bool(ok)))
    return rows


def run(seed: int = 0) -> list[Row]:
    """Every variant in every dtype."""
    return [row for name, overrides in VARIANTS.items() for row in verify_variant(name, overrides, seed)]


def format_rows(rows: list[Row]) -> str:
    w = max([len("variant")] + [len(r.variant) for r in rows]) + 2
    head = (f"{'variant':<{w}}{'dtype':<10}{'|E-A| logit':>12}{'|E-A| out':>11}{'E err':>10}{'A err':>10}"
            f"{'tolerance':>11}  ok")
    lines = [head]
    for r in rows:
        lines.append(f"{r.variant:<{w}}{r.dtype:<10}{r.max_abs_logit_diff:>12.2e}{r.max_abs_output_diff:>11.2e}"
                     f"{r.explicit_logit_err:>10.2e}{r.absorbed_logit_err:>10.2e}{r.tolerance:>11.2e}  "
                     f"{'ok' if r.ok else 'FAIL'}")
    lines.append("float64: |E-A| <= 1e-10 x max|logit| (and the same for outputs). float32/bfloat16: the absorbed "
                 "error against the float64 reference (A err) <= 2 x the explicit path's own error (E err) + 1 ulp "
                 "at the largest value, for logits (tolerance shown) and outputs.")
    return "\n".join(lines)
