"""Which path a forward call takes, and the calls refused before any work."""

import pytest
import torch

from qkmla import MLA, FullKVCache, LatentCache, MLAConfig
from qkmla.attention.paths import resolve_path


@pytest.fixture
def mla():
    return MLA(MLAConfig()).eval()


def x_of(mla, T, B=2):
    return torch.randn(B, T, mla.config.hidden_size)


def test_auto_resolves_by_cache_and_length(mla):
    empty = LatentCache.from_config(mla.config, 2, 16)
    assert resolve_path(mla, x_of(mla, 5), None, "auto", None) == "explicit"
    assert resolve_path(mla, x_of(mla, 5), FullKVCache.from_config(mla.config, 2, 16), "auto", None) == "explicit"
    assert resolve_path(mla, x_of(mla, 5), empty, "auto", None) == "explicit"  # a prefill
    assert resolve_path(mla, x_of(mla, 1), empty, "auto", None) == "absorbed"  # a first decode step
    mla(x_of(mla, 3), empty)
    assert resolve_path(mla, x_of(mla, 5), empty, "auto", None) == "absorbed"  # a chunk after the prefill
    assert resolve_path(mla, x_of(mla, 5), empty, "expand", None) == "expand"


@pytest.mark.parametrize("path, cache, lengths, message", [
    ("fast", None, None, r"path: expected one of \('auto', 'explicit', 'absorbed', 'expand'\), got 'fast'"),
    ("absorbed", None, None, "path: 'absorbed' reads a latent cache"),
    ("expand", "full", None, "path: 'expand' reads a latent cache"),
    ("auto", None, torch.tensor([5, 5]), "input_lengths: only meaningful with a cache"),
    ("explicit", "filled", None, "path: 'explicit' with a latent cache is only a prefill into an empty cache"),
    ("auto", "wrong", None, "cache: expected a LatentCache, a FullKVCache or None, got dict"),
])
def test_refused_calls_name_the_argument(mla, path, cache, lengths, message):
    caches = {None: None, "full": FullKVCache.from_config(mla.config, 2, 16), "wrong": {}}
    if cache == "filled":
        caches["filled"] = LatentCache.from_config(mla.config, 2, 16)
        mla(x_of(mla, 3), caches["filled"])
    with pytest.raises(ValueError, match=message):
        resolve_path(mla, x_of(mla, 5), caches[cache], path, lengths)
