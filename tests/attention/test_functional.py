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


def test_sdpa_marks_the_rows_a_nan_reaches_as_the_kernel_aligns_them():
    """sdpa's NaN rows (the CPU's fused kernel answers 0 for a row whose every logit is NaN): a NaN key reaches
    the causal rows that see it, with is_causal's alignment (query i sees keys 0..i) when T != S, and a NaN in
    one head's logit scale makes that head's rows NaN, as its logits are (the absorbed path refuses the scale)."""
    from qkmla.attention.functional import sdpa

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 2, 8, generator=g) for n in (2, 5, 5))
    for j, want in ((0, [[1, 1], [1, 1]]), (1, [[0, 0], [1, 1]]), (4, [[0, 0], [0, 0]])):
        bad = k.clone()
        bad[:, j] = float("nan")
        assert sdpa(q, bad, v, 8 ** -0.5, causal=True).isnan().any(-1)[0].int().tolist() == want, j
    scale = torch.tensor([float("nan"), 8 ** -0.5])
    out = sdpa(q, k[:, :2], v[:, :2], scale, causal=True)
    assert out[:, :, 0].isnan().all() and out[:, :, 1].isfinite().all()
