import pytest

from qkmla.cache.size import CACHE_PRESETS, CacheShape, cache_rows, format_bytes, format_table


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


def test_flashmla_656_bytes_per_token_at_deepseek_v3_width():
    """fp8: 512 e4m3 + 4 float32 scales + 64 bf16 RoPE values = 656 B for MLA; the QK-norm
    scalars add G of their own dtype (bf16 here: 128 groups at full width, 16 at TP=8)."""
    for preset, groups in (("deepseek-v3", 128), ("deepseek-v3-tp8", 16)):
        r = {row["variant"]: row for row in cache_rows(CACHE_PRESETS[preset].replace(kv_format="fp8"), 1)}
        assert r["mla"]["bytes_per_token_layer"] == 656
        assert r["mla-qknorm"]["bytes_per_token_layer"] == 656 + 2 * groups
        assert r["mla"]["values_per_token_layer"] == 576  # the values are the same; their bytes are not
    shape = CACHE_PRESETS["deepseek-v3"]
    rows_of = {f: {row["variant"]: row for row in cache_rows(shape.replace(kv_format=f), 1)} for f in ("int8", "int4")}
    assert rows_of["int8"]["mla"]["bytes_per_token_layer"] == 512 + 4 + 128
    assert rows_of["int4"]["mla"]["bytes_per_token_layer"] == 256 + 16 * 4 + 128
    # an MHA head's key and value are one quantized vector each: 128 codes + a scale (fp8)
    mha = {row["variant"]: row for row in cache_rows(shape.replace(kv_format="fp8"), 1)}["mha"]
    assert mha["bytes_per_token_layer"] == 2 * 128 * (128 + 4)


def test_unknown_kv_format_is_refused():
    with pytest.raises(ValueError, match=r"kv_format: expected one of \('dense', 'fp8', 'int8', 'int4'\)"):
        CACHE_PRESETS["tiny"].replace(kv_format="nf4")


@pytest.mark.parametrize("n, text", [(999, "999 B"), (1_000, "1.0 kB"), (10_500_000_000, "10.5 GB"),
                                     (3_997_696 * 10**9, "4.0 PB"), (2 * 10**12, "2.0 TB"),
                                     (4 * 10**21, "4000.0 EB")])
def test_format_bytes_has_a_unit_for_every_size(n, text):
    """A request of 10**12 tokens read "3997696000.0 GB" before; now the largest decimal unit."""
    assert format_bytes(n) == text
