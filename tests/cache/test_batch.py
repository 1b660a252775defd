"""The batch and capacity operations generation utilities need: select (beam reorder, repeat),
grow, and roll back the last tokens."""

import pytest
import torch

from qkmla import MLA, LatentCache, MLAConfig
from qkmla.cache import H2O
from qkmla.cache.storage import PagedLayout


def filled(policy=None, capacity=16):
    torch.manual_seed(0)
    cfg = MLAConfig()
    mla = MLA(cfg).double().eval()
    cache = LatentCache.from_config(cfg, 3, capacity, dtype=torch.float64, policy=policy)
    x = torch.randn(3, 6, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        mla(x, cache, input_lengths=torch.tensor([6, 4, 5]))
    return mla, cache


def test_select_sequences_moves_every_field_and_length():
    _, cache = filled()
    latent, scales = cache.load()
    cache.select_sequences(torch.tensor([2, 0, 0, 1]))
    assert cache.batch_size == 4 and cache.seqlens.tolist() == [5, 6, 6, 4]
    latent2, scales2 = cache.load()
    for new, old in enumerate([2, 0, 0, 1]):
        n = int(cache.seqlens[new])
        assert torch.equal(latent2[new, :n], latent[old, :n]) and torch.equal(scales2[new, :n], scales[old, :n])
    with pytest.raises(ValueError, match=r"indices: expected a non-empty 1-D tensor of sequence indices in \[0, 4\)"):
        cache.select_sequences(torch.tensor([4]))


@pytest.mark.parametrize("pick", [[0, 0], [1, 1], [1, 0]])
def test_select_sequences_then_a_write_goes_where_planned(pick):
    """select_sequences moved seqlens but left max_len and uniform as they were: picking [0, 0] of lengths [1, 2]
    kept max_len 2 and uniform False, and the next plan()'s slot was refused at append as edited (a beam search's
    reorder, then a decode step). The lengths' summary now moves with them."""
    cache = LatentCache(2, 8, 8, 4)
    cache.append(cache.plan(2, 2, input_lengths=torch.tensor([1, 2])), c_kv=torch.zeros(2, 2, 8),
                 k_rope=torch.zeros(2, 2, 4))
    cache.select_sequences(torch.tensor(pick))
    lengths = [[1, 2][i] for i in pick]
    assert (cache.max_len, cache.uniform) == (max(lengths), lengths[0] == lengths[1])
    cache.append(cache.plan(2, 1), c_kv=torch.ones(2, 1, 8), k_rope=torch.ones(2, 1, 4))
    assert cache.seqlens.tolist() == [n + 1 for n in lengths]
    c_kv = cache.load()[0]
    assert all(c_kv[b, n].eq(1).all() and c_kv[b, :n].eq(0).all() for b, n in enumerate(lengths))


def test_select_sequences_carries_an_eviction_policys_scores():
    _, cache = filled(policy=H2O(budget=4, window=1))
    scores = cache.eviction.scores.clone()
    cache.select_sequences(torch.tensor([1, 1]))
    assert torch.equal(cache.eviction.scores, scores[[1, 1]]) and cache.eviction.batch_size == 2


def test_grow_keeps_rows_and_a_decode_step_continues():
    mla, cache = filled(capacity=6)
    latent, _ = cache.load()
    cache.grow(9)
    assert cache.capacity == 9 and torch.equal(cache.load()[0], latent)
    with torch.no_grad():
        mla(torch.randn(3, 1, mla.config.hidden_size, dtype=torch.float64), cache)
    assert cache.seqlens.tolist() == [7, 5, 6]


def test_drop_last_rolls_back_and_refuses_what_it_cannot():
    mla, cache = filled()
    x = torch.randn(3, 2, mla.config.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        want = mla(x, cache)
        cache.drop_last(torch.tensor([2, 2, 2]))
        assert cache.seqlens.tolist() == [6, 4, 5]
        assert torch.equal(mla(x, cache), want)
    with pytest.raises(ValueError, match="counts: expected"):
        cache.drop_last(torch.tensor([9, 0, 0]))
    _, evicting = filled(policy=H2O(budget=4, window=1))
    with pytest.raises(ValueError, match="eviction policy cannot roll tokens back"):
        evicting.drop_last(torch.tensor([1, 1, 1]))


def test_paged_caches_are_refused():
    cfg = MLAConfig()
    cache = LatentCache.from_config(cfg, 2, 8, layout=PagedLayout(block_size=4))
    with pytest.raises(ValueError, match="layout: select_sequences needs the contiguous layout"):
        cache.select_sequences(torch.tensor([0]))
