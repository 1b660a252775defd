"""The shared-KV (DeepSeek-V4) cache: its size per token, its rows, its shape check."""

import pytest
import torch

from qkmla.cache.shared_kv import SharedKVCache
from qkmla.config import SharedKVConfig

CFG = SharedKVConfig(hidden_size=48, num_heads=3, head_dim=20, rope_head_dim=6, q_lora_rank=12)


def test_cache_bytes_per_token():
    """One vector of D per token and layer: D x element size, what the config says."""
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        cache = SharedKVCache.from_config(CFG, 1, 8, dtype=dtype)
        assert cache.bytes_per_token == CFG.cache_floats_per_token * size == 20 * size
        assert cache.nbytes == 8 * 20 * size


def test_rows_come_back_in_order_and_a_mismatched_layer_is_refused():
    cache = SharedKVCache.from_config(CFG, 2, 6)
    rows = torch.randn(2, 4, 1, 20)
    slot = cache.plan(2, 4)
    torch.testing.assert_close(cache.update(slot, rows), rows)
    slot = cache.plan(2, 1)
    assert cache.update(slot, rows[:, :1]).shape == (2, 5, 1, 20)
    with pytest.raises(ValueError, match="head_dim=24"):
        cache.check_config(CFG.replace(head_dim=24))
    with pytest.raises(ValueError, match="head_dim"):
        SharedKVCache(1, 4, 0)


@pytest.mark.parametrize("make, name", [
    (lambda: SharedKVCache(1, 8, 2**64 - 1), "head_dim"),
    (lambda: __import__("qkmla.cache.full", fromlist=["FullKVCache"]).FullKVCache(1, 8, 2**40, 8, 8),
     "num_kv_heads x k_dim"),
    (lambda: SharedKVCache(1, 2**40, 8), "capacity"),
    (lambda: SharedKVCache(2**26, 1, 512), "capacity")])  # review 16a: the batch, blamed on head_dim
def test_a_width_past_memory_is_named_not_the_capacity(make, name):
    """SharedKVCache(1, 8, 2**64 - 1) was refused naming capacity=8, the one size that was fine."""
    with pytest.raises(ValueError, match=rf"^{name}: .* GiB of memory available"):
        make()
