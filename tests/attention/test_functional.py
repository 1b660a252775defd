"""attention/functional.py: the checks every attention layer runs before its work."""

from types import SimpleNamespace

import pytest
import torch

from qkmla import LatentCache, MLA, MLAConfig
from qkmla.attention.functional import check_cache_device


def test_a_cache_names_the_device_its_buffers_are_on():
    """A cache records where torch put its buffers ("cpu:0" is "cpu", "cuda" the current index), so a
    forward compares like with like: a cache built as "cpu:0" was refused for x on "cpu" by a check
    that compared the names, and one built as "cuda" let x through on any index."""
    config = MLAConfig()
    cache = LatentCache.from_config(config, 2, 8, device="cpu:0")
    assert cache.device == torch.device("cpu")
    out = MLA(config)(torch.randn(2, 3, config.hidden_size), cache)
    assert out.shape == (2, 3, config.hidden_size)
    with pytest.raises(ValueError, match="^cache: its buffers are on meta and x is on cpu"):
        check_cache_device(LatentCache.from_config(config, 2, 8, device="meta"), torch.zeros(1))


def test_another_index_of_the_same_kind_is_refused():
    """No GPU needed: the check reads devices alone."""
    on = SimpleNamespace
    with pytest.raises(ValueError, match="^cache: its buffers are on cuda:0 and x is on cuda:1"):
        check_cache_device(on(device=torch.device("cuda:0")), on(device=torch.device("cuda:1")))
    check_cache_device(on(device=torch.device("cuda:1")), on(device=torch.device("cuda:1")))
