"""attention/functional.py: the checks every attention layer runs before its work."""

from types import SimpleNamespace

import pytest
import torch

from qkmla.attention.functional import check_cache_device


def test_a_device_without_an_index_is_the_current_one(monkeypatch):
    """A cache built with device="cuda" has its buffers on the current device; x on another index of
    the same kind is refused (the check took "cuda" for every index, and torch failed later)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # no GPU needed: the check reads devices alone
    cache = SimpleNamespace(device=torch.device("cuda"))
    check_cache_device(cache, SimpleNamespace(device=torch.device("cuda", 0)))
    with pytest.raises(ValueError, match="^cache: its buffers are on cuda and x is on cuda:1"):
        check_cache_device(cache, SimpleNamespace(device=torch.device("cuda", 1)))
    check_cache_device(SimpleNamespace(device=torch.device("cpu")), torch.zeros(1))
    with pytest.raises(ValueError, match="^cache: its buffers are on meta and x is on cpu"):
        check_cache_device(SimpleNamespace(device=torch.device("meta")), torch.zeros(1))
