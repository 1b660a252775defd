import pytest
import torch

from qkmla import FullKVCache, LatentCache, MLAConfig, PagedLayout, mla_preset
from qkmla.cache.size import CACHE_PRESETS, cache_rows


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v3-tp8"])
def test_allocated_bytes_equal_the_formula(preset):
    """Measured cache bytes per token equal cache_rows' formula, for all three caches."""
    cfg = mla_preset(preset)
    rows = {r["variant"]: r for r in cache_rows(CACHE_PRESETS[preset], 1)}
    capacity = 64
    caches = {
        "mla": LatentCache.from_config(cfg.replace(qk_norm=None), 1, capacity, dtype=torch.bfloat16),
        "mla-qknorm": LatentCache.from_config(cfg, 1, capacity, dtype=torch.bfloat16),
        "mla-qknorm-full-key": FullKVCache.from_config(cfg, 1, capacity, dtype=torch.bfloat16),
    }
    for name, cache in caches.items():
        assert cache.nbytes == capacity * cache.bytes_per_token
        assert cache.bytes_per_token == rows[name]["bytes_per_token_layer"], name
    ratio = caches["mla-qknorm-full-key"].nbytes / caches["mla-qknorm"].nbytes
    expected = {"deepseek-v3": 58.18, "deepseek-v3-tp8": 8.65}[preset]
    assert ratio == pytest.approx(expected, abs=0.01)


def test_scalar_dtype_separate():
    cfg = mla_preset("deepseek-v3-tp8")
    cache = LatentCache.from_config(cfg, 2, 8, dtype=torch.bfloat16, scalar_dtype=torch.float32)
    assert cache.bytes_per_token == 576 * 2 + 16 * 4
    assert cache.fields["key_scale"].width == 16


def test_paged_cache_bytes():
    cache = LatentCache.from_config(MLAConfig(), 2, 10, layout=PagedLayout(block_size=4))
    assert cache.nbytes == 2 * 3 * 4 * cache.bytes_per_token  # 3 blocks of 4 per sequence


def test_plan_checks_capacity_and_reset():
    cache = LatentCache.from_config(MLAConfig(), 1, 4)
    slot = cache.plan(1, 3)
    cache.append(slot, c_kv=torch.zeros(1, 3, 32), k_rope=torch.zeros(1, 3, 8), key_scale=torch.ones(1, 3, 4))
    assert cache.seqlens.tolist() == [3] and cache.max_len == 3
    with pytest.raises(ValueError, match="capacity=4"):
        cache.plan(1, 2)
    with pytest.raises(ValueError, match="key_scale"):
        cache.append(cache.plan(1, 1), c_kv=torch.zeros(1, 1, 32), k_rope=torch.zeros(1, 1, 8))
    cache.reset()
    assert cache.seqlens.tolist() == [0] and cache.max_len == 0


def test_read_zeroes_slots_past_each_length():
    cache = LatentCache(2, 4, kv_lora_rank=2, qk_rope_head_dim=2, fill=float("nan"))
    slot = cache.plan(2, 3, input_lengths=torch.tensor([3, 1]))
    cache.append(slot, c_kv=torch.ones(2, 3, 2), k_rope=torch.ones(2, 3, 2))
    got = cache.read("latent")
    assert got.shape == (2, 3, 4)
    assert got[0].eq(1).all() and got[1, 0].eq(1).all() and got[1, 1:].eq(0).all()


def test_bad_sizes():
    with pytest.raises(ValueError, match="capacity"):
        LatentCache(1, 0, 4, 2)
    with pytest.raises(ValueError, match="batch_size"):
        LatentCache(-1, 4, 4, 2)


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype=torch.int32), "dtype: expected a floating-point torch.dtype"),
    (dict(scalar_dtype=torch.int8), "scalar_dtype: expected a floating-point"),
    (dict(kv_lora_rank=0), "kv_lora_rank: expected an int >= 1"),
    (dict(qk_rope_head_dim=-2), "qk_rope_head_dim: expected an int >= 1"),
    (dict(num_kv_groups=-1), "num_kv_groups: expected an int >= 0"),
])
def test_latent_cache_refuses_bad_construction(kwargs, message):
    args = dict(batch_size=1, capacity=4, kv_lora_rank=8, qk_rope_head_dim=4, num_kv_groups=2) | kwargs
    with pytest.raises(ValueError, match=message):
        LatentCache(**args)


def test_full_cache_refuses_bad_construction():
    from qkmla import FullKVCache

    with pytest.raises(ValueError, match="dtype: expected a floating-point"):
        FullKVCache(1, 4, 2, 8, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="k_dim: expected an int >= 1"):
        FullKVCache(1, 4, 2, 0, 8)


def test_a_tokens_slot_and_its_position_are_tracked_apart():
    """Slots say where rows are stored and what attention reads; positions say which RoPE
    position a new token gets. With positions ahead of the slots (as after dropping cached
    tokens), a write goes to the next free slots and the positions keep counting."""
    cache = LatentCache(2, 8, kv_lora_rank=2, qk_rope_head_dim=2, fill=float("nan"))
    cache.append(cache.plan(2, 3), c_kv=torch.zeros(2, 3, 2), k_rope=torch.zeros(2, 3, 2))
    cache.next_positions = cache.next_positions + torch.tensor([4, 1])  # as a policy that dropped tokens would
    slot = cache.plan(2, 2, positions=torch.tensor([[7, 8], [4, 5]]))
    assert slot.slots.tolist() == [[3, 4], [3, 4]] and slot.positions.tolist() == [[7, 8], [4, 5]]
    cache.append(slot, c_kv=torch.ones(2, 2, 2), k_rope=torch.ones(2, 2, 2))
    assert cache.seqlens.tolist() == [5, 5] and cache.next_positions.tolist() == [9, 6]
    latent, key_scale = cache.load()
    assert key_scale is None and latent.shape == (2, 5, 4)
    assert latent[:, :3].eq(0).all() and latent[:, 3:].eq(1).all()


def test_append_checks_the_row_parts():
    cache = LatentCache.from_config(MLAConfig(), 2, 4)
    slot = cache.plan(2, 1)
    with pytest.raises(ValueError, match=r"k_rope: expected a tensor \[B=2, T=1, 8\]"):
        cache.append(slot, c_kv=torch.zeros(2, 1, 32), k_rope=torch.zeros(2, 1, 7), key_scale=torch.ones(2, 1, 4))
    assert cache.seqlens.tolist() == [0, 0]


def test_an_unscaled_float8_cache_is_refused():
    import pytest

    for kw in (dict(dtype=torch.float8_e4m3fn), dict(scalar_dtype=torch.float8_e5m2)):
        with pytest.raises(ValueError, match="2 bytes or more.*kv_format='fp8'"):
            LatentCache(1, 8, 16, 8, 2, **kw)


def test_a_dense_cache_below_the_model_precision_reads_back_the_rounded_latent():
    """The key scalars come from the latent as stored: for a bfloat16 cache, c rounded to it."""
    c = torch.randn(3, 16, dtype=torch.float64)
    assert torch.equal(LatentCache(1, 8, 16, 8, 2, dtype=torch.bfloat16).stored_latent(c), c.bfloat16().double())
    assert LatentCache(1, 8, 16, 8, 2, dtype=torch.float64).stored_latent(c) is c


def test_boolean_input_lengths_are_refused():
    """Issue 27, class 3: True/False read as lengths 1/0 silently."""
    from qkmla import MLA

    mla = MLA(MLAConfig())
    cache = LatentCache.from_config(mla.config, 2, 8)
    with pytest.raises(ValueError, match=r"input_lengths: expected an integer tensor of shape \[2\], got torch.bool"):
        mla(torch.randn(2, 3, mla.config.hidden_size), cache, input_lengths=torch.tensor([True, False]))
