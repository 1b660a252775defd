"""Row formats of the latent cache (``kv_format``): dense, or a quantized latent with its scales.

A format turns a token's latent c [d_c] and normalized, rotated RoPE key k^R [d_r] into the
row the cache stores (``encode``) and back into [c ; k^R] (``decode``). The key scalars r
are not part of it: they are a separate field in ``scalar_dtype``, never quantized with
the latent. :data:`KV_FORMATS`:

    "dense"  [c ; k^R] in the cache's dtype (the default)
    "fp8"    c as float8_e4m3fn, one float32 scale per tile of 128 values (amax / 448)  FlashMLA
    "int8"   c as int8, one float32 scale per token (symmetric, amax / 127)
    "int4"   c as int4 in [-7, 7], two per byte, one float32 scale per group of 32 values (amax / 7)

A quantized row is one uint8 row per token; the RoPE key stays bfloat16, as in FlashMLA
(a tenth of the row, and it carries position, which rounding would blur):

    byte 0                                scale_offset                 rope_offset        row_bytes
    | codes (d_c B, or d_c / 2 for int4) | pad | float32 scale x n_scales | pad | k^R bfloat16 x d_r | pad |

    fp8,  d_c 512, d_r 64:   512 + 4 x 4  + 64 x 2 = 656 bytes   (FlashMLA's layout, byte for byte)
    int8, d_c 512, d_r 64:   512 + 4 x 1  + 64 x 2 = 644 bytes
    int4, d_c 512, d_r 64:   256 + 4 x 16 + 64 x 2 = 448 bytes

Each part starts at a multiple of its element size and a row is a multiple of 4 bytes, so
every part of every row can be viewed in its own dtype; padding appears only when d_c is
not a multiple of 4 (fp8, int8) or 8 (int4). A d_c that is not a multiple of the group
ends in a shorter last group (d_c 200 in fp8: tiles of 128 and 72 values), quantized the
same way, so every width has every format.

Dequantization is ``c[i] = code[i] * scale[i // group]`` in float32. Scales are float32
(exact; a bfloat16 scale would add up to 2^-9 relative error for 2 bytes) and equal to
amax / code_max, so a group's largest value maps to the largest code; a group of zeros
stores scale 1, and a group so small that amax / code_max is below float32's smallest
normal number (1.2e-38) stores that number (its codes then stay below code_max). fp8 codes round to nearest even (torch's cast); int codes round half to even.
A zero byte reads as 0 in every part, and a 0xFF byte as NaN (a NaN scale, code or RoPE
value), so zeroed rows read as zeros and NaN-filled ones poison any stray read.

This module is a leaf (torch only): the cache (``qkmla.cache.codecs``) and every decode
backend (``qkmla.ops.mla_decode``) read rows through it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .utils.checked import check_size

KV_FORMATS = ("dense", "fp8", "int8", "int4")
ROPE_DTYPE = torch.bfloat16  # the RoPE key of every quantized format


def _align(offset: int, size: int) -> int:
    return -(-offset // size) * size


@dataclass(frozen=True)
class RowLayout:
    """Byte offsets of a quantized row: codes, float32 scales, bfloat16 RoPE key."""

    code_bytes: int
    num_scales: int
    qk_rope_head_dim: int
    scale_offset: int
    rope_offset: int
    row_bytes: int

    def split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """uint8 rows [..., row_bytes] -> (codes uint8 [..., code_bytes], scales float32
        [..., num_scales], k^R bfloat16 [..., d_r])."""
        codes = rows[..., :self.code_bytes]
        scales = rows[..., self.scale_offset:self.scale_offset + 4 * self.num_scales]
        rope = rows[..., self.rope_offset:self.rope_offset + 2 * self.qk_rope_head_dim]
        return codes, scales.contiguous().view(torch.float32), rope.contiguous().view(ROPE_DTYPE)


def dense_row(c_kv: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
    """[c ; k^R] [..., d_c + d_r] in c's dtype (a caller that checked the widths: the dense cache's codec)."""
    return torch.cat((c_kv, k_rope.to(c_kv.dtype)), dim=-1)


class DenseRows:
    """The dense format: one row [c ; k^R] of d_c + d_r values in the cache's dtype.

    A row format is resolved once from its name and the widths (:func:`row_format`) and handed
    down as this object: the cache stores through it and every decode backend reads through it,
    asking ``quantized`` rather than comparing names."""

    name = "dense"
    quantized = False  # rows of values in the cache's dtype; a quantized format's rows are uint8 bytes

    def __init__(self, kv_lora_rank: int, qk_rope_head_dim: int):
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim

    @property
    def width(self) -> int:
        """Row width: d_c + d_r values (dense) or the row's bytes (quantized)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype rows are stored in, for a cache of ``dtype``."""
        return dtype

    def part_dtypes(self, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """{"c_kv": ..., "k_rope": ...}: the dtype each part is held in by a cache of ``dtype`` (a value past its
        range is lost there)."""
        return {"c_kv": dtype, "k_rope": dtype}

    def check_parts(self, c_kv, k_rope) -> None:
        """A ValueError naming ``c_kv`` or ``k_rope`` unless they are floating-point [..., d_c] and [..., d_r] of
        the same tokens: a c of another width failed deep in the quantizer ("unflatten: Provided sizes [1, 32]
        don't multiply up to ...") or made a dense row of the wrong width without a word."""
        for name, t, width in (("c_kv", c_kv, self.kv_lora_rank), ("k_rope", k_rope, self.qk_rope_head_dim)):
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[-1] != width or not t.is_floating_point():
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"{t!r:.80}"
                raise ValueError(f"{name}: expected a floating-point tensor [..., {width}] for these {self.name!r} "
                                 f"rows (d_c={self.kv_lora_rank}, d_r={self.qk_rope_head_dim}), got {got}")
        if c_kv.shape[:-1] != k_rope.shape[:-1]:
            raise ValueError(f"k_rope: expected the tokens of c_kv {tuple(c_kv.shape[:-1])}, got "
                             f"{tuple(k_rope.shape[:-1])}")
        if k_rope.device != c_kv.device:  # one row holds both: failed in its concatenation, naming neither
            raise ValueError(f"k_rope: c_kv is on {c_kv.device} and k_rope on {k_rope.device}; one row holds both, "
                             f"so pass k_rope.to({str(c_kv.device)!r})")

    def check_rows(self, rows) -> None:
        """A ValueError naming ``rows`` unless they are this format's stored rows [..., width]: uint8 bytes of a
        quantized format (float rows were read as bytes, zeros or garbage without a word, and rows of another
        byte width failed in a view, "storage_offset() must be divisible by 4"), values of a dense one."""
        want = "uint8 bytes" if self.quantized else "floating-point values"
        if not isinstance(rows, torch.Tensor) or rows.dim() == 0 or rows.shape[-1] != self.width or (
                rows.dtype != torch.uint8 if self.quantized else not rows.is_floating_point()):
            got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, torch.Tensor) else f"{rows!r:.80}"
            raise ValueError(f"rows: expected {want} [..., {self.width}] ({self.name!r} rows of "
                             f"d_c={self.kv_lora_rank}, d_r={self.qk_rope_head_dim}), got {got}")

    def encode(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> torch.Tensor:
        """Rows [..., width] from c [..., d_c] and k^R [..., d_r]."""
        self.check_parts(c_kv, k_rope)
        return dense_row(c_kv, k_rope)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [..., width] back as [c ; k^R] [..., d_c + d_r] (dense: the rows themselves;
        quantized: float32)."""
        self.check_rows(rows)
        return rows

    @staticmethod
    def stored_latent(c_kv: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """c [..., d_c] as a cache of this format reads it back: dense rows stored in ``dtype``
        are c rounded to it (None: c itself)."""
        return c_kv if dtype is None else c_kv.to(dtype).to(c_kv.dtype)


class QuantizedRows(DenseRows):
    """Codes and float32 scales (one per ``group`` values) of c, and a bfloat16 k^R, in one
    uint8 row; subclasses say how codes are made and read."""

    quantized = True
    group = 0  # values per scale; 0: the whole latent (one scale per token)
    code_max: float  # a group's amax maps here
    values_per_byte = 1

    def __init__(self, kv_lora_rank: int, qk_rope_head_dim: int):
        super().__init__(kv_lora_rank, qk_rope_head_dim)
        self.group_size = self.group or kv_lora_rank
        code_bytes = -(-kv_lora_rank // self.values_per_byte)
        num_scales = -(-kv_lora_rank // self.group_size)
        scale_offset = _align(code_bytes, 4)
        rope_offset = scale_offset + 4 * num_scales
        self.layout = RowLayout(code_bytes, num_scales, qk_rope_head_dim, scale_offset, rope_offset,
                                _align(rope_offset + 2 * qk_rope_head_dim, 4))

    @property
    def width(self) -> int:
        return self.layout.row_bytes

    def storage_dtype(self, dtype):
        return torch.uint8

    def part_dtypes(self, dtype):  # codes of float32 scales, read back in float32; the RoPE key in bfloat16
        return {"c_kv": torch.float32, "k_rope": ROPE_DTYPE}

    def quantize(self, c_kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c [..., d_c] -> (codes uint8 [..., code_bytes], scales float32 [..., num_scales])."""
        d_c, g = self.kv_lora_rank, self.group_size
        n = -(-d_c // g)
        c = torch.nn.functional.pad(c_kv.float(), (0, n * g - d_c)).unflatten(-1, (n, g))  # [..., n, g]
        amax = c.abs().amax(dim=-1, keepdim=True)
        # A scale below float32's smallest normal number would lose its precision, and amax /
        # code_max may underflow to 0 (codes c / 0 = NaN): a group that small is scaled by
        # that smallest normal instead, which keeps its codes within range (|c| / tiny < code_max).
        tiny = torch.finfo(torch.float32).tiny
        scale = torch.where(amax > 0, (amax / self.code_max).clamp_min(tiny), torch.ones_like(amax))
        # A NaN or inf in a group makes its scale NaN, so the group reads back as NaN (as a
        # dense cache would pass it on), never as finite codes of a meaningless scale.
        scale = torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))
        return self.to_codes((c / scale).flatten(-2)[..., :d_c]), scale.squeeze(-1)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """(codes uint8 [..., code_bytes], scales float32 [..., num_scales]) -> c float32 [..., d_c]."""
        d_c = self.kv_lora_rank
        return self.from_codes(codes)[..., :d_c] * scales.repeat_interleave(self.group_size, dim=-1)[..., :d_c]

    def to_codes(self, units: torch.Tensor) -> torch.Tensor:
        """Values in units of their scale (|u| <= code_max) [..., d_c] -> codes uint8 [..., code_bytes]."""
        raise NotImplementedError

    def from_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes uint8 [..., code_bytes] -> values in units of their scale, float32 [..., >= d_c]."""
        raise NotImplementedError

    def encode(self, c_kv, k_rope):
        self.check_parts(c_kv, k_rope)
        lay = self.layout
        codes, scales = self.quantize(c_kv)
        parts = [(codes, 0), (scales, lay.scale_offset), (k_rope.to(ROPE_DTYPE), lay.rope_offset), (None, lay.row_bytes)]
        row, end = [], 0
        for part, offset in parts:  # zero bytes where alignment leaves a gap
            row.append(codes.new_zeros(*codes.shape[:-1], offset - end))
            if part is not None:
                row.append(part.contiguous().view(torch.uint8))
                end = offset + row[-1].shape[-1]
        return torch.cat(row, dim=-1)

    def decode(self, rows):
        self.check_rows(rows)
        codes, scales, k_rope = self.layout.split(rows)
        return torch.cat((self.dequantize(codes, scales), k_rope.float()), dim=-1)

    def stored_latent(self, c_kv, dtype=None):  # the rows are bytes: ``dtype`` plays no part
        return self.dequantize(*self.quantize(c_kv)).to(c_kv.dtype)


class Fp8Rows(QuantizedRows):
    """float8_e4m3fn codes, one scale per tile of 128 values (FlashMLA)."""

    name, group, code_max = "fp8", 128, 448.0

    def to_codes(self, units):
        return units.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)

    def from_codes(self, codes):
        return codes.view(torch.float8_e4m3fn).float()


class Int8Rows(QuantizedRows):
    """int8 codes round(c / scale) in [-127, 127], one scale per token."""

    name, code_max = "int8", 127.0

    def to_codes(self, units):
        return units.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)

    def from_codes(self, codes):
        return codes.view(torch.int8).float()


class Int4Rows(QuantizedRows):
    """int4 codes round(c / scale) in [-7, 7], stored as code + 8 in a nibble: value 2i in the
    low nibble of byte i, value 2i + 1 in the high one; one scale per group of 32 values."""

    name, group, code_max, values_per_byte = "int4", 32, 7.0, 2

    def to_codes(self, units):
        nibbles = (units.round().clamp(-7, 7) + 8).to(torch.uint8)
        nibbles = torch.nn.functional.pad(nibbles, (0, nibbles.shape[-1] % 2))  # an odd d_c ends in a 0 nibble
        return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)

    def from_codes(self, codes):
        return torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).float() - 8


ROW_FORMATS = {"dense": DenseRows, "fp8": Fp8Rows, "int8": Int8Rows, "int4": Int4Rows}


def check_kv_format(kv_format, device=None) -> None:
    """ValueError naming ``kv_format`` unless it is a known format (that ``device``, when
    given, can store)."""
    if not isinstance(kv_format, str) or kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format: expected one of {KV_FORMATS}, got {kv_format!r}")
    if device is not None and kv_format == "fp8" and not float8_supported(device):
        allowed = tuple(f for f in KV_FORMATS if f != "fp8")
        raise ValueError(f"kv_format: 'fp8' needs torch.float8_e4m3fn, which this torch build cannot convert on "
                         f"device {torch.device(device)}; allowed here: {allowed}")


@functools.lru_cache(maxsize=None)
def _float8_on(device: str) -> bool:
    try:
        torch.ones(2, device=device).to(torch.float8_e4m3fn).view(torch.uint8).view(torch.float8_e4m3fn).float()
    except (AttributeError, RuntimeError, TypeError):
        return False
    return True


def float8_supported(device) -> bool:
    """Whether float8_e4m3fn values can be made and read on ``device`` (cast both ways)."""
    return hasattr(torch, "float8_e4m3fn") and _float8_on(str(torch.device(device)))


def row_format(kv_format, kv_lora_rank: int, qk_rope_head_dim: int) -> DenseRows:
    """The row format ``kv_format`` for these widths: a name of :data:`KV_FORMATS` (checked), or a
    row format already resolved (checked against the widths), handed back as it is."""
    if isinstance(kv_format, DenseRows):
        if (kv_format.kv_lora_rank, kv_format.qk_rope_head_dim) != (kv_lora_rank, qk_rope_head_dim):
            raise ValueError(f"kv_format: a {kv_format.name!r} row format of d_c={kv_format.kv_lora_rank}, "
                             f"d_r={kv_format.qk_rope_head_dim}, but these rows have d_c={kv_lora_rank}, "
                             f"d_r={qk_rope_head_dim}")
        return kv_format
    check_kv_format(kv_format)
    # kv_lora_rank=0 failed in a quantized row's block arithmetic ("integer division or modulo by zero").
    # A RoPE part may be empty (cache-size's arithmetic of vectors without one). The decode op passes its
    # queries' widths, which a traced forward gives as SymInts or tensors (check_size takes those as they are).
    check_size("kv_lora_rank", kv_lora_rank, 1)
    check_size("qk_rope_head_dim", qk_rope_head_dim, 0)
    return ROW_FORMATS[kv_format](kv_lora_rank, qk_rope_head_dim)
