"""A LatentCache in every kv_format: fields, bytes, reads, layouts, refusals."""

import pytest
import torch

from qkmla import LatentCache, MLAConfig, PagedLayout, kv_formats, mla_preset
from qkmla.cache import KV_FORMATS
from qkmla.cache.codecs import LatentCodec, QuantizedCodec
from qkmla.cache.size import CACHE_PRESETS, cache_rows
from qkmla.kv_formats import row_format


@pytest.mark.parametrize("kv_format", KV_FORMATS)
def test_fields_store_load(kv_format):
    codec = LatentCodec() if kv_format == "dense" else QuantizedCodec(row_format(kv_format, 32, 8))
    fields = codec.fields(32, 8, 4, torch.bfloat16, torch.float32)
    width, dtype = fields["latent"]
    assert (width, dtype) == ((40, torch.bfloat16) if kv_format == "dense" else (row_format(kv_format, 32, 8).width,
                                                                                  torch.uint8))
    assert fields["key_scale"] == (4, torch.float32) and "key_scale" not in codec.fields(32, 8, 0, torch.float32,
                                                                                         torch.float32)
    c, k_rope, r = torch.randn(2, 3, 32), torch.randn(2, 3, 8), torch.rand(2, 3, 4)
    rows = codec.store(c, k_rope, r)
    assert rows["latent"].shape == (2, 3, width)
    latent, key_scale = codec.load(rows)
    assert latent.dtype == torch.float32 and latent.shape == (2, 3, 40) and key_scale is r  # scalars never quantized
    torch.testing.assert_close(latent[..., 32:], k_rope, rtol=2 ** -8, atol=0)  # RoPE: bf16 at worst
    assert torch.equal(latent[..., :32], codec.stored_latent(c))


@pytest.mark.parametrize("kv_format", KV_FORMATS)
@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v3-tp8", "tiny"])
def test_bytes_per_token_agree_with_cache_size(kv_format, preset):
    """LatentCache.bytes_per_token == qkmla cache-size's figure, for each format (bf16
    cache, bf16 scalars), with and without the QK-norm scalars."""
    cfg = mla_preset(preset)
    shape = CACHE_PRESETS[preset].replace(dtype="bf16", kv_format=kv_format)
    rows = {r["variant"]: r for r in cache_rows(shape, 1)}
    for name, c in (("mla", cfg.replace(qk_norm=None)), ("mla-qknorm", cfg.replace(qk_norm="rms"))):
        cache = LatentCache.from_config(c, 1, 8, dtype=torch.bfloat16, kv_format=kv_format)
        assert cache.bytes_per_token == rows[name]["bytes_per_token_layer"], name
        assert cache.nbytes == 8 * cache.bytes_per_token


def test_fp8_cache_is_656_bytes_per_token_at_deepseek_v3_width():
    cfg = mla_preset("deepseek-v3")
    plain = LatentCache.from_config(cfg.replace(qk_norm=None), 1, 4, dtype=torch.bfloat16, kv_format="fp8")
    assert plain.bytes_per_token == 656
    qk = LatentCache.from_config(cfg.replace(qk_norm="rms"), 1, 4, dtype=torch.bfloat16, kv_format="fp8",
                                 scalar_dtype=torch.float32)
    assert qk.bytes_per_token == 656 + 128 * 4


@pytest.mark.parametrize("kv_format", ["fp8", "int8", "int4"])
def test_paged_and_contiguous_read_the_same_dequantized_rows(kv_format):
    """NaN-filled never-written slots (0xFF bytes) read as zeros past a shorter sequence's
    length; load() returns the dequantized latent in the cache's dtype, and it is what
    stored_latent says the cache reads back."""
    torch.manual_seed(0)
    kw = dict(kv_lora_rank=24, qk_rope_head_dim=8, num_kv_groups=2, dtype=torch.float64, fill=float("nan"),
              kv_format=kv_format)
    table = torch.randperm(6).view(2, 3)
    caches = [LatentCache(2, 12, **kw), LatentCache(2, 12, layout=PagedLayout(4, block_table=table), **kw)]
    c, k_rope, r = torch.randn(2, 7, 24, dtype=torch.float64), torch.randn(2, 7, 8), torch.rand(2, 7, 2)
    for cache in caches:
        cache.append(cache.plan(2, 7, input_lengths=torch.tensor([7, 3])), c_kv=c, k_rope=k_rope, key_scale=r)
    (lat0, r0), (lat1, r1) = caches[0].load(), caches[1].load()
    assert lat0.dtype == torch.float64 and torch.equal(lat0, lat1) and torch.equal(r0, r1)
    assert lat0[1, 3:].eq(0).all() and not lat0.isnan().any()
    assert torch.equal(lat0[0, :, :24], caches[0].stored_latent(c[0]))
    assert caches[1].decode_view()["kv_format"].name == kv_format
    assert caches[0].fields["latent"].data.dtype == torch.uint8
    assert (caches[0].fields["latent"].data[:, 7:] == 0xFF).all()  # never written: NaN bytes


def test_dense_cache_is_unchanged():
    cache = LatentCache.from_config(MLAConfig(), 2, 4)
    assert cache.kv_format == "dense" and cache.decode_view()["kv_format"].name == "dense"
    c = torch.randn(1, 32)
    assert cache.stored_latent(c) is c


def test_refusals(monkeypatch):
    """Each refused before any storage is allocated, naming the argument and what it allows."""
    cfg = MLAConfig()
    with pytest.raises(ValueError, match=r"kv_format: expected one of \('dense', 'fp8', 'int8', 'int4'\), got 'e5m2'"):
        LatentCache.from_config(cfg, 1, 4, kv_format="e5m2")
    with pytest.raises(ValueError, match="fill: a 'int8' cache fills never-written slots with 0 or NaN, got 1.5"):
        LatentCache.from_config(cfg, 1, 4, kv_format="int8", fill=1.5)
    monkeypatch.setattr(kv_formats, "float8_supported", lambda device: False)
    with pytest.raises(ValueError, match=r"kv_format: 'fp8' needs torch.float8_e4m3fn.*allowed here: "
                                         r"\('dense', 'int8', 'int4'\)"):
        LatentCache.from_config(cfg, 1, 4, kv_format="fp8")
    LatentCache.from_config(cfg, 1, 4, kv_format="int4")  # the other formats need no float8
