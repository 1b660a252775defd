"""The row formats of the latent cache: byte layouts, quantization error bounds, fill bytes."""

import pytest
import torch

from qkmla import kv_formats
from qkmla.kv_formats import KV_FORMATS, row_format

QUANTIZED = ("fp8", "int8", "int4")


@pytest.mark.parametrize("kv_format,d_c,d_r,layout", [
    ("fp8", 512, 64, (512, 4, 512, 528, 656)),  # FlashMLA: 512 fp8 + 4 fp32 scales + 64 bf16
    ("int8", 512, 64, (512, 1, 512, 516, 644)),
    ("int4", 512, 64, (256, 16, 256, 320, 448)),
    ("fp8", 200, 8, (200, 2, 200, 208, 224)),  # tiles of 128 and 72 values
    ("fp8", 23, 6, (23, 1, 24, 28, 40)),  # odd d_c: the scales start at the next multiple of 4
    ("int4", 23, 6, (12, 1, 12, 16, 28)),  # 23 codes in 12 bytes, the last nibble 0
])
def test_row_layouts(kv_format, d_c, d_r, layout):
    lay = row_format(kv_format, d_c, d_r).layout
    assert (lay.code_bytes, lay.num_scales, lay.scale_offset, lay.rope_offset, lay.row_bytes) == layout
    assert row_format(kv_format, d_c, d_r).width == layout[-1] and lay.row_bytes % 4 == 0


def test_fp8_row_is_flashmla_byte_for_byte():
    """Bytes 0-511: e4m3 codes of c / scale per 128-value tile (torch's own cast); 512-527:
    the four float32 scales amax / 448; 528-655: the RoPE key in bfloat16."""
    torch.manual_seed(0)
    c, k_rope = torch.randn(3, 512) * torch.linspace(0.1, 4, 512), torch.randn(3, 64)
    row = row_format("fp8", 512, 64).encode(c, k_rope)
    assert row.dtype == torch.uint8 and row.shape == (3, 656)
    scale = c.view(3, 4, 128).abs().amax(-1) / 448
    codes = (c.view(3, 4, 128) / scale[..., None]).to(torch.float8_e4m3fn).view(3, 512)
    assert torch.equal(row[:, :512], codes.view(torch.uint8))
    assert torch.equal(row[:, 512:528].contiguous().view(torch.float32), scale)
    assert torch.equal(row[:, 528:].contiguous().view(torch.bfloat16), k_rope.to(torch.bfloat16))


@pytest.mark.parametrize("d_c", [512, 200, 23])
@pytest.mark.parametrize("kv_format", QUANTIZED)
def test_round_trip_error_is_within_the_format_bound(kv_format, d_c):
    """|c^ - c| <= half a code step: int8/int4 amax / (2 code_max) of the value's group; fp8
    2^-4 |c| (3 mantissa bits) or, below e4m3's normal range, 2^-10 of the tile's scale. The
    largest value of each group comes back (to float32 roundoff)."""
    torch.manual_seed(1)
    fmt = row_format(kv_format, d_c, 8)
    c = torch.randn(64, d_c) * torch.exp(torch.randn(64, 1))
    c_hat = fmt.decode(fmt.encode(c, torch.zeros(64, 8)))[:, :d_c]
    _, scales = fmt.quantize(c)
    scale = scales.repeat_interleave(fmt.group_size, dim=-1)[:, :d_c]  # each value's scale
    err = (c_hat - c).abs()
    bound = torch.maximum(2 ** -4 * c.abs(), 2 ** -10 * scale) if kv_format == "fp8" else scale / 2
    assert (err <= bound * (1 + 1e-6)).all()
    assert err.max() > 0.1 * bound.max()  # the bound is close to what happens, not vacuous
    group_max = c.abs().argmax(dim=-1, keepdim=True) if kv_format == "int8" else None
    if group_max is not None:
        torch.testing.assert_close(c_hat.gather(1, group_max), c.gather(1, group_max), rtol=1e-6, atol=0)
    assert torch.equal(fmt.stored_latent(c), c_hat)  # what the key scalars are computed from


@pytest.mark.parametrize("kv_format", QUANTIZED)
def test_zeros_and_fill_bytes(kv_format):
    """A zero latent stores scale 1 and reads back 0; all-zero bytes read as 0 and all-0xFF
    bytes as NaN (the fill values of never-written slots)."""
    fmt = row_format(kv_format, 40, 8)
    row = fmt.encode(torch.zeros(2, 40), torch.zeros(2, 8))
    _, scales, _ = fmt.layout.split(row)
    assert scales.eq(1).all() and fmt.decode(row).eq(0).all()
    assert fmt.decode(torch.zeros(2, fmt.width, dtype=torch.uint8)).eq(0).all()
    assert fmt.decode(torch.full((2, fmt.width), 0xFF, dtype=torch.uint8)).isnan().all()


def test_int4_packs_value_2i_in_the_low_nibble():
    fmt = row_format("int4", 32, 2)
    c = torch.zeros(1, 32)
    c[0, 0], c[0, 1], c[0, 2] = 7.0, -7.0, 3.0  # scale 1: codes 7, -7, 3 stored as 15, 1, 11
    row = fmt.encode(c, torch.zeros(1, 2))
    assert row[0, 0] == 15 | (1 << 4) and row[0, 1] == 11 | (8 << 4)


def test_dense_rows_are_the_concatenation():
    fmt = row_format("dense", 4, 2)
    c, k_rope = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 2)
    row = fmt.encode(c, k_rope)
    assert row.dtype == torch.float64 and torch.equal(row, torch.cat((c, k_rope.double()), -1))
    assert fmt.decode(row) is row and fmt.stored_latent(c) is c and fmt.width == 6


def test_bad_formats(monkeypatch):
    assert KV_FORMATS == ("dense", "fp8", "int8", "int4")
    with pytest.raises(ValueError, match=r"kv_format: expected one of \('dense', 'fp8', 'int8', 'int4'\), got 'fp4'"):
        row_format("fp4", 8, 2)
    with pytest.raises(ValueError, match="kv_format: expected one of"):
        kv_formats.check_kv_format(None)
    kv_formats.check_kv_format("fp8", "cpu")  # this torch casts float8 on the CPU
    monkeypatch.setattr(kv_formats, "float8_supported", lambda device: False)
    with pytest.raises(ValueError, match=r"kv_format: 'fp8' needs torch.float8_e4m3fn.*on device cpu; "
                                         r"allowed here: \('dense', 'int8', 'int4'\)"):
        kv_formats.check_kv_format("fp8", "cpu")


@pytest.mark.parametrize("kv_format", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_latent_reads_back_as_nan_not_as_finite_codes(kv_format, bad):
    from qkmla.kv_formats import row_format

    rows = row_format(kv_format, 256, 16)
    c = torch.randn(2, 256)
    c[0, 5] = bad
    back = rows.dequantize(*rows.quantize(c))
    group = 256 if kv_format == "int8" else rows.group_size
    assert back[0, :group].isnan().all()  # the group holding it (the whole row for int8's one scale)
    assert back[1].isfinite().all() and back[0, group:].isfinite().all()


@pytest.mark.parametrize("kv_format", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("magnitude", [1e-40, 1e-44, 3e-38])
def test_latents_too_small_for_their_scale_read_back_finite(kv_format, magnitude):
    """Issue 27, class 3: amax / code_max underflows (or is subnormal) for latents this small;
    they read back finite and within float32's smallest normal number of what was stored."""
    fmt = row_format(kv_format, 64, 8)
    c = torch.full((2, 64), magnitude)
    c[0, ::3] *= -1
    c[1, 0] = 1.0  # a group of ordinary size beside tiny ones (int8 scales the whole row)
    back = fmt.decode(fmt.encode(c, torch.zeros(2, 8)))[:, :64]
    assert torch.isfinite(back).all()
    tiny = torch.finfo(torch.float32).tiny
    assert (back[0] - c[0]).abs().max() <= tiny
