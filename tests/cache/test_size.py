import pytest

from qkmla.cache.size import CACHE_PRESETS, CacheShape, cache_rows, format_table


def rows(preset, tokens=32000):
    return {r["variant"]: r for r in cache_rows(CACHE_PRESETS[preset], tokens)}


def test_llama_3_70b_published_figures():
    r = rows("llama-3-70b")
    assert r["gqa"]["bytes_per_request"] == 2 * 80 * 8 * 128 * 32000 * 2 == 10_485_760_000
    assert round(r["gqa"]["bytes_per_request"] / 1e9, 1) == 10.5
    assert round(r["mha"]["bytes_per_request"] / 1e9) == 84
    assert rows("llama-3-70b-mha")["gqa"]["bytes_per_request"] == r["mha"]["bytes_per_request"]
    assert "mla" not in r


def test_deepseek_v2_values_per_token():
    r = rows("deepseek-v2")
    assert r["mla"]["values_per_token_layer"] == 576
    shape = CACHE_PRESETS["deepseek-v2"]
    assert shape.num_heads * shape.head_dim == 16_384
    assert 16_384 / 576 == pytest.approx(28.4, abs=0.05)


def test_deepseek_v3_tp8_scalar_overhead():
    r = rows("deepseek-v3-tp8")
    assert r["mla"]["bytes_per_token_layer"] == 1152
    assert r["mla-qknorm"]["bytes_per_token_layer"] - r["mla"]["bytes_per_token_layer"] == 32
    assert 32 / 1152 == pytest.approx(0.028, abs=0.0005)
    text = format_table(CACHE_PRESETS["deepseek-v3-tp8"], cache_rows(CACHE_PRESETS["deepseek-v3-tp8"], 1), "x")
    assert "add 32 bytes to 1,152" in text and "(2.78%)" in text


def test_full_key_ratio():
    assert rows("deepseek-v3")["mla-qknorm-full-key"]["bytes_per_token_layer"] / \
        rows("deepseek-v3")["mla-qknorm"]["bytes_per_token_layer"] == pytest.approx(58.18, abs=0.01)


def test_bad_shape_and_tokens():
    with pytest.raises(ValueError, match="dtype"):
        CacheShape(num_layers=1, num_heads=1, head_dim=1, num_kv_heads=1, dtype="int4")
    with pytest.raises(ValueError, match="num_heads"):
        CacheShape(num_layers=1, num_heads=0, head_dim=1, num_kv_heads=1)
    with pytest.raises(ValueError, match="tokens"):
        cache_rows(CACHE_PRESETS["tiny"], 0)
