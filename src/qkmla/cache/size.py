"""Cache bytes per token and per request, from MATH.md "Cache size per token and layer":

    MHA / GQA / MQA:         2 · kv_heads · d_head · bytes
    MLA:                     (d_c + d_r) · bytes
    QK-normed MLA:           MLA + G · scalar_bytes
    full-key QK-norm MLA:    G · (d_n + d_r + d_v) · bytes     (the naive cache the paper avoids)

A quantized ``kv_format`` (``qkmla.kv_formats``: "fp8", "int8", "int4") stores each cached
vector as codes plus float32 scales, and keeps RoPE values in bfloat16 where the cache holds
them apart: the MLA latent is one vector of d_c with its d_r RoPE key beside it (fp8 at
DeepSeek-V3 width: 512 + 4 x 4 + 64 x 2 = 656 bytes, FlashMLA's row), an MHA/GQA head's key
and value are one vector of d_head each, a full key is d_n quantized plus d_r RoPE values.
The QK-norm scalars stay in ``scalar_dtype``.

The per-layer figures are exactly what :class:`~qkmla.cache.LatentCache` and
:class:`~qkmla.cache.FullKVCache` allocate per token (tests check both against each other,
and LatentCache's for every format).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..config import MLA_PRESETS, PRESET_NUM_LAYERS, check_groups, check_positive_int, check_rope
from ..kv_formats import KV_FORMATS, check_kv_format, row_format
from ..utils.checked import as_int, is_int, python_numbers

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
# ``qkmla cache-size --kv-dtype``: a dense dtype, or a quantized format (with its scales).
DENSE_KV_DTYPES = ("bf16", "fp16", "fp32")
KV_DTYPES = DENSE_KV_DTYPES + tuple(f for f in KV_FORMATS if f != "dense")


@dataclass(frozen=True)
class CacheShape:
    """What the cache size of a model depends on.

    The MHA/GQA/MQA rows use ``num_heads`` query heads of ``head_dim``, GQA with
    ``num_kv_heads``. The MLA rows need ``kv_lora_rank`` and ``qk_rope_head_dim``; the
    full-key row also needs ``qk_nope_head_dim`` and ``v_head_dim``.
    """

    num_layers: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    kv_lora_rank: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    num_kv_groups: Optional[int] = None  # G; None means num_heads (DeepSeek)
    dtype: str = "bf16"
    scalar_dtype: Optional[str] = None  # None means dtype
    kv_format: str = "dense"  # or a quantized format of qkmla.kv_formats: cached vectors as codes + scales

    def __post_init__(self) -> None:
        """The configs' own checks: a shape no model could have is refused."""
        python_numbers(self)  # np.int64(2) is the int 2 (utils.checked)
        check_kv_format(self.kv_format)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "kv_format":
                continue
            if f.name in ("dtype", "scalar_dtype"):
                # a str first: dtype=["bf16"] failed in the dict's lookup ("unhashable type: 'list'")
                if v is not None and (not isinstance(v, str) or v not in DTYPE_BYTES):
                    raise ValueError(f"{f.name}: expected one of {sorted(DTYPE_BYTES)}, got {v!r:.80}")
            else:
                check_positive_int(f.name, v, allow_none=True)
        check_groups("num_kv_heads", self.num_kv_heads, self.num_heads)
        if self.num_kv_groups is not None:
            check_groups("num_kv_groups", self.num_kv_groups, self.num_heads)
        if self.qk_rope_head_dim is not None:
            check_rope("qk_rope_head_dim", self.qk_rope_head_dim, 10000.0)
        # An MLA size given without the rest of an MLA shape would be dropped without a word.
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            given, missing = (("kv_lora_rank", "qk_rope_head_dim") if self.qk_rope_head_dim is None
                              else ("qk_rope_head_dim", "kv_lora_rank"))
            raise ValueError(f"{missing}: {given}={getattr(self, given)} describes an MLA cache, which also needs "
                             f"{missing} (the {'RoPE key width' if missing == 'qk_rope_head_dim' else 'latent width'}); "
                             "give both, or neither for MHA/GQA/MQA alone")
        # The full-key row needs both widths: one alone dropped the row without a word (qk_nope_head_dim=128 and no
        # v_head_dim printed the MLA rows alone)
        if self.kv_lora_rank is not None and (self.qk_nope_head_dim is None) != (self.v_head_dim is None):
            given, missing = (("qk_nope_head_dim", "v_head_dim") if self.v_head_dim is None
                              else ("v_head_dim", "qk_nope_head_dim"))
            raise ValueError(f"{missing}: {given}={getattr(self, given)} sizes the full-key row, which also needs "
                             f"{missing}; give both, or neither")
        if self.kv_lora_rank is None:
            # scalar_dtype too: the key scalars are the QK-normed MLA rows' alone (a title saying
            # "scalars fp8" over MHA/GQA/MQA rows would have dropped it without a word).
            for name in ("qk_nope_head_dim", "v_head_dim", "num_kv_groups", "scalar_dtype"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}: sizes the MLA rows, which need kv_lora_rank and qk_rope_head_dim too; "
                                     "give them, or drop it")

    @property
    def has_mla(self) -> bool:
        return self.kv_lora_rank is not None and self.qk_rope_head_dim is not None

    @property
    def groups(self) -> int:
        return self.num_kv_groups or self.num_heads

    def replace(self, **changes) -> "CacheShape":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def _from_mla_preset(name: str, dtype: str = "bf16") -> CacheShape:
    cfg = MLA_PRESETS[name]
    return CacheShape(
        num_layers=PRESET_NUM_LAYERS[name], num_heads=cfg.num_heads, head_dim=cfg.qk_nope_head_dim,
        num_kv_heads=min(8, cfg.num_heads), kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim, num_kv_groups=cfg.num_kv_groups, dtype=dtype,
    )


# MLA presets compare against an MHA of their head count with d_head = d_n (DeepSeek-V2's
# "128 heads x 128" baseline) and a GQA with 8 KV heads; Llama-3-70B has no MLA rows.
CACHE_PRESETS: dict[str, CacheShape] = {
    **{name: _from_mla_preset(name) for name in MLA_PRESETS},
    "llama-3-70b": CacheShape(num_layers=80, num_heads=64, head_dim=128, num_kv_heads=8, dtype="fp16"),
    "llama-3-70b-mha": CacheShape(num_layers=80, num_heads=64, head_dim=128, num_kv_heads=64, dtype="fp16"),
}


def vector_bytes(shape: CacheShape, values: int, rope: int = 0) -> int:
    """Bytes of one cached vector of ``values`` values and ``rope`` RoPE values beside them:
    all in ``dtype`` (dense), or the values quantized and the RoPE values in bfloat16 (the
    row of :mod:`qkmla.kv_formats`, alignment included)."""
    rows = row_format(shape.kv_format, values, rope)
    return rows.width if rows.quantized else rows.width * DTYPE_BYTES[shape.dtype]


def cache_rows(shape: CacheShape, tokens: int) -> list[dict]:
    """One dict per cache variant: values and bytes per token (one layer, all layers) and per request."""
    tokens = as_int(tokens)  # np.int64(4096) was refused as "expected a positive int ..., got np.int64(4096)"
    if not is_int(tokens) or not 1 <= tokens < 2**63:
        raise ValueError(f"tokens: expected a positive int below 2**63, got {tokens!r}")
    b_s = DTYPE_BYTES[shape.scalar_dtype or shape.dtype]
    d = shape.head_dim
    variants = [  # (name, values, scalars, bytes of the values)
        ("mha", 2 * shape.num_heads * d, 0, 2 * shape.num_heads * vector_bytes(shape, d)),
        ("gqa", 2 * shape.num_kv_heads * d, 0, 2 * shape.num_kv_heads * vector_bytes(shape, d)),
        ("mqa", 2 * d, 0, 2 * vector_bytes(shape, d)),
    ]
    if shape.has_mla:
        latent = shape.kv_lora_rank + shape.qk_rope_head_dim
        latent_bytes = vector_bytes(shape, shape.kv_lora_rank, shape.qk_rope_head_dim)
        variants += [("mla", latent, 0, latent_bytes), ("mla-qknorm", latent, shape.groups, latent_bytes)]
        if shape.qk_nope_head_dim and shape.v_head_dim:
            full = shape.groups * (shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim)
            full_bytes = shape.groups * (vector_bytes(shape, shape.qk_nope_head_dim, shape.qk_rope_head_dim)
                                         + vector_bytes(shape, shape.v_head_dim))
            variants.append(("mla-qknorm-full-key", full, 0, full_bytes))
    rows = []
    for name, values, scalars, value_bytes in variants:
        per_layer = value_bytes + scalars * b_s
        rows.append({
            "variant": name, "values_per_token_layer": values, "scalars_per_token_layer": scalars,
            "bytes_per_token_layer": per_layer, "bytes_per_token": per_layer * shape.num_layers,
            "tokens": tokens, "bytes_per_request": per_layer * shape.num_layers * tokens,
        })
    mla = next((r for r in rows if r["variant"] == "mla"), None)
    for r in rows:
        r["ratio_to_mla"] = r["bytes_per_token_layer"] / mla["bytes_per_token_layer"] if mla else None
    return rows


def format_bytes(n: int) -> str:
    """Decimal units, as the published figures use (10.5 GB = 10.5e9 bytes)."""
    for unit, scale in (("EB", 1e18), ("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


_COLUMN_WIDTHS = (22, 18, 13, 12, 18, 10, 8)  # variant (left-aligned), then the numbers (right-aligned)


def format_table(shape: CacheShape, rows: list[dict], title: str) -> str:
    """The text table ``qkmla cache-size`` prints."""
    stored = shape.dtype if shape.kv_format == "dense" else f"{shape.kv_format} + float32 scales, RoPE bf16"
    head = (f"{title}: {shape.num_layers} layers, {shape.num_heads} heads x {shape.head_dim}, "
            f"GQA {shape.num_kv_heads} KV heads, {stored} (scalars {shape.scalar_dtype or shape.dtype}), "
            f"{rows[0]['tokens']:,} tokens")
    header = ["variant", "values/tok/layer", "B/tok/layer", "B/tok", "B/request", "", "vs MLA"]
    cells = []
    for r in rows:
        values = f"{r['values_per_token_layer']:,}" + (f" + {r['scalars_per_token_layer']}s"
                                                        if r["scalars_per_token_layer"] else "")
        ratio = f"{r['ratio_to_mla']:.3f}x" if r["ratio_to_mla"] else "-"
        cells.append([r["variant"], values, f"{r['bytes_per_token_layer']:,}", f"{r['bytes_per_token']:,}",
                      f"{r['bytes_per_request']:,}", format_bytes(r["bytes_per_request"]), ratio])
    # The usual widths, widened where a value needs it (one space at least between columns): at
    # fixed widths a long request (--tokens 10**12) or a wide shape ran the numbers together
    # ("3,997,6963,997,696,000,...").
    widths = [max(usual, *(len(c[i]) + 1 for c in cells)) for i, usual in enumerate(_COLUMN_WIDTHS)]
    lines = [head] + [f"{line[0]:<{widths[0]}}" + "".join(f"{c:>{w}}" for c, w in zip(line[1:], widths[1:]))
                      for line in [header] + cells]
    by = {r["variant"]: r for r in rows}
    if "mla-qknorm" in by:
        extra = by["mla-qknorm"]["bytes_per_token_layer"] - by["mla"]["bytes_per_token_layer"]
        lines.append(f"QK-norm scalars add {extra} bytes to {by['mla']['bytes_per_token_layer']:,} per token and layer "
                     f"({100 * extra / by['mla']['bytes_per_token_layer']:.2f}%); the full-key QK-norm cache is "
                     f"{by['mla-qknorm-full-key']['bytes_per_token_layer'] / by['mla-qknorm']['bytes_per_token_layer']:.1f}x "
                     "the QK-normed latent cache." if "mla-qknorm-full-key" in by else
                     f"QK-norm scalars add {extra} bytes per token and layer.")
        keys_only = shape.num_heads * shape.head_dim
        lines.append(f"MLA caches {by['mla']['values_per_token_layer']:,} values per token and layer vs "
                     f"{keys_only:,} for {shape.num_heads}x{shape.head_dim} MHA keys "
                     f"({keys_only / by['mla']['values_per_token_layer']:.1f}x) and {2 * keys_only:,} for keys and values "
                     f"({2 * keys_only / by['mla']['values_per_token_layer']:.1f}x).")
    return "\n".join(lines)
