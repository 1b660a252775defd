"""Eviction policies on hand-built scores: which slots each keeps, and the arguments they refuse."""

import pytest
import torch

from qkmla import LatentCache, MLAConfig
from qkmla.cache import H2O, POLICIES, SnapKV, StreamingLLM, WriteSlot, make_policy


def kept(mask: torch.Tensor) -> list[list[int]]:
    return [row.nonzero().flatten().tolist() for row in mask]


def per_head(*rows) -> torch.Tensor:
    """[B, h, S] scores from nested lists [b][h][j]."""
    return torch.tensor(rows, dtype=torch.float64)


def prefill_slot(lengths: list[int], T: int) -> WriteSlot:
    """The plan of a right-padded prefill of ``lengths`` tokens into empty sequences."""
    cache = LatentCache(len(lengths), T, kv_lora_rank=2, qk_rope_head_dim=2)
    return cache.plan(len(lengths), T, input_lengths=torch.tensor(lengths))


# -- StreamingLLM -------------------------------------------------------------------------------


def test_streaming_llm_keeps_sinks_and_the_newest_tokens():
    policy = StreamingLLM(sinks=2, budget=5)
    seqlens = torch.tensor([10, 4, 6])
    mask = policy.keep_mask(None, seqlens, seen=seqlens)
    assert kept(mask) == [[0, 1, 7, 8, 9], [0, 1, 2, 3], [0, 1, 3, 4, 5]]


def test_streaming_llm_with_a_kept_fraction_of_the_tokens_seen():
    """k = max(ceil(f seen), sinks + 1): a sequence that has seen 30 tokens (10 of them already
    evicted) keeps ceil(0.1 * 30) = 3, exactly (0.1 * 30 is 3.0000000000000004 in floats)."""
    policy = StreamingLLM(sinks=1, kept_fraction=0.1)
    seqlens = torch.tensor([20, 9, 1])
    mask = policy.keep_mask(None, seqlens, seen=torch.tensor([30, 9, 1]))
    assert kept(mask) == [[0, 18, 19], [0, 8], [0]]


# -- H2O ------------------------------------------------------------------------------------------


def test_h2o_keeps_the_window_and_the_heaviest_hitters():
    """Two heads, 8 slots, budget 5 with window 2: slots 6 and 7 are kept whatever their score,
    then the three best of slots 0..5 by the mean over heads (3: 0.9, 1: 0.6, 4: 0.55)."""
    scores = per_head([[0.1, 0.2, 0.0, 0.9, 0.0, 1.0, 0.0, 0.0],
                       [0.0, 1.0, 0.3, 0.9, 1.1, 0.0, 0.0, 0.0]])
    seqlens = torch.tensor([8])
    mean = H2O(budget=5, window=2).keep_mask(scores, seqlens, seqlens)
    assert kept(mean) == [[1, 3, 4, 6, 7]]  # means: 0.05 0.6 0.15 0.9 0.55 0.5 (slot 5 just misses)
    best = H2O(budget=5, window=2, head_reduce="max").keep_mask(scores, seqlens, seqlens)
    assert kept(best) == [[1, 4, 5, 6, 7]]  # maxima: 0.1 1.0 0.3 0.9 1.1 1.0: slot 3 loses
    tie = H2O(budget=4, window=2, head_reduce="max").keep_mask(scores, seqlens, seqlens)
    assert kept(tie) == [[1, 4, 6, 7]]  # slots 1 and 5 tie at 1.0: the earlier one stays


def test_h2o_sinks_and_uneven_lengths():
    """Sequence 1 is shorter: its slots past length 4 hold stale scores and are never kept."""
    scores = per_head([[5.0, 0.0, 3.0, 1.0, 2.0, 0.0]],
                      [[0.0, 9.0, 1.0, 0.0, 7.0, 7.0]])
    seqlens = torch.tensor([6, 4])
    mask = H2O(budget=4, window=1, sinks=1).keep_mask(scores, seqlens, seqlens)
    assert kept(mask) == [[0, 2, 4, 5], [0, 1, 2, 3]]


def test_h2o_observes_every_real_query():
    slot = prefill_slot([3, 5], 5)
    assert H2O(budget=8, window=1).observed(slot, prefill=True).tolist() == [[True] * 3 + [False] * 2, [True] * 5]


# -- SnapKV --------------------------------------------------------------------------------------


def test_snapkv_observes_the_last_window_prompt_tokens():
    slot = prefill_slot([6, 2, 4], 6)
    observed = SnapKV(budget=4, window=3).observed(slot, prefill=True)
    assert observed.int().tolist() == [[0, 0, 0, 1, 1, 1], [1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0]]
    decode = WriteSlot(slots=torch.tensor([[6], [2], [4]]), positions=torch.tensor([[6], [2], [4]]), valid=None,
                       seqlens=torch.tensor([7, 3, 5]), next_positions=torch.tensor([7, 3, 5]), max_len=7,
                       uniform=False)
    assert SnapKV(budget=4, window=3).observed(decode, prefill=False) is None  # prompts only by default
    assert SnapKV(budget=4, window=3, interval=2).observed(decode, prefill=False).all()


def test_snapkv_pools_the_prefix_scores():
    """One head, 11 slots, window 2 (slots 9 and 10, kept; their large scores must not leak
    into slot 8's pool). Raw, the best two of the prefix are slots 1 (0.8) and 6 (0.5);
    averaged over 3 slots, 6 (1.1 / 3) and 5 (0.9 / 3) beat the isolated spike at 1 (0.8 / 3);
    max-pooled, the spike spreads to slots 0..2 (ties: the earlier slot)."""
    scores = per_head([[0.0, 0.8, 0.0, 0.0, 0.0, 0.4, 0.5, 0.2, 0.0, 50.0, 50.0]])
    seqlens = torch.tensor([11])
    assert kept(SnapKV(budget=4, window=2, kernel_size=1).keep_mask(scores, seqlens, seqlens)) == [[1, 6, 9, 10]]
    assert kept(SnapKV(budget=4, window=2, kernel_size=3).keep_mask(scores, seqlens, seqlens)) == [[5, 6, 9, 10]]
    peak = SnapKV(budget=5, window=2, kernel_size=3, pooling="max").keep_mask(scores, seqlens, seqlens)
    assert kept(peak) == [[0, 1, 2, 9, 10]]


def test_snapkv_without_pooling_is_the_window_attention():
    """kernel_size 1: the kept prefix tokens are the ones the window attended to most, over heads."""
    scores = per_head([[0.2, 0.5, 0.1, 0.3, 0.0, 0.0], [0.4, 0.0, 0.1, 0.1, 0.0, 0.0]])  # means .3 .25 .1 .2
    seqlens = torch.tensor([6])
    assert kept(SnapKV(budget=4, window=2, kernel_size=1).keep_mask(scores, seqlens, seqlens)) == [[0, 1, 4, 5]]


# -- budgets and schedules -------------------------------------------------------------------


def test_a_kept_fraction_of_one_keeps_everything():
    seqlens = torch.tensor([17, 3])
    for policy in (StreamingLLM(sinks=4, kept_fraction=1.0), H2O(kept_fraction=1.0, window=2),
                   SnapKV(kept_fraction=1, window=2)):
        mask = policy.keep_mask(torch.rand(2, 3, 17), seqlens, seqlens)
        assert mask.sum(dim=1).tolist() == [17, 3]


def test_scores_follow_their_slots_through_a_compaction():
    """H2O's per-head scores move with the tokens; SnapKV's observation is spent."""
    scores = torch.arange(12.0).view(2, 1, 6)  # [B=2, h=1, S=6]
    order = torch.tensor([[1, 4, 5, 0, 2, 3], [0, 2, 1, 3, 4, 5]])  # kept slots first
    seqlens = torch.tensor([3, 2])
    moved = H2O(budget=3, window=1).compacted(scores, order, seqlens)
    assert moved.tolist() == [[[1.0, 4.0, 5.0]], [[6.0, 8.0, 0.0]]]
    assert SnapKV(budget=3, window=1).compacted(scores, order, seqlens) is None


def test_make_policy_by_name():
    assert set(POLICIES) == {"streaming-llm", "h2o", "snapkv"}
    policy = make_policy("h2o", budget=64, window=8, head_reduce="max")
    assert isinstance(policy, H2O) and policy.head_reduce == "max"
    assert "reposition=True" in repr(make_policy("streaming-llm", budget=8, reposition=True))


# -- bad input ----------------------------------------------------------------------------------


BAD = [
    (lambda: make_policy("lru", budget=8), r"policy: expected one of \('streaming-llm', 'h2o', 'snapkv'\), got 'lru'"),
    (lambda: H2O(kept_fraction=0.0), r"kept_fraction: expected a number in \(0, 1\], got 0.0"),
    (lambda: H2O(kept_fraction=1.5), r"kept_fraction: expected a number in \(0, 1\], got 1.5"),
    (lambda: H2O(kept_fraction=-0.25), r"kept_fraction: expected a number in \(0, 1\]"),
    (lambda: H2O(kept_fraction=float("nan")), r"kept_fraction: expected a number in \(0, 1\]"),
    (lambda: H2O(kept_fraction=True), r"kept_fraction: expected a number in \(0, 1\]"),
    (lambda: H2O(), r"budget, kept_fraction: give exactly one"),
    (lambda: H2O(budget=8, kept_fraction=0.5), r"budget, kept_fraction: give exactly one"),
    (lambda: H2O(budget=10, window=8, sinks=4), r"budget: expected an int >= 12 \(sinks \+ window = 4 \+ 8"),
    (lambda: StreamingLLM(sinks=4, budget=4), r"budget: expected an int >= 5 \(sinks \+ window = 4 \+ 1"),
    (lambda: SnapKV(budget=16), r"budget: expected an int >= 32"),
    (lambda: H2O(budget=8.0, window=2), r"budget: expected an int >= 2"),
    (lambda: H2O(budget=8, window=2, interval=0), r"interval: expected an int >= 1 .* or None"),
    (lambda: StreamingLLM(budget=8, interval=-3), r"interval: expected an int >= 1"),
    (lambda: H2O(budget=8, window=-1), r"window: expected an int >= 0"),
    (lambda: StreamingLLM(sinks=-1, budget=8), r"sinks: expected an int >= 0"),
    (lambda: H2O(budget=8, window=2, head_reduce="sum"), r"head_reduce: expected one of \('mean', 'max'\), got 'sum'"),
    (lambda: SnapKV(budget=8, window=0), r"window: expected an int >= 1 \(the observation window\)"),
    (lambda: SnapKV(budget=8, window=2, kernel_size=4), r"kernel_size: expected an odd int"),
    (lambda: SnapKV(budget=8, window=2, pooling="median"), r"pooling: expected one of \('avg', 'max'\)"),
    (lambda: StreamingLLM(budget=8, reposition="yes"), r"reposition: expected True or False"),
    (lambda: LatentCache.from_config(MLAConfig(), 1, 8, policy="h2o"), r"policy: expected an EvictionPolicy"),
]


@pytest.mark.parametrize("make,message", BAD, ids=[f"{i}-{m.split(':')[0]}" for i, (_, m) in enumerate(BAD)])
def test_bad_arguments_are_refused_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_make_policy_names_a_mistyped_argument():
    from qkmla.cache.eviction import make_policy

    with pytest.raises(ValueError, match="policy 'h2o': .*bugdet"):
        make_policy("h2o", bugdet=8)


def test_a_tiny_kept_fraction_keeps_at_least_one_token():
    """Issue 27, class 3: 1e-300 of a few tokens is ceil(...) = 1 token, not 0 (the fraction's
    rational approximation had rounded it to 0, and the cache kept nothing)."""
    from qkmla.cache import H2O

    policy = H2O(kept_fraction=1e-300, window=0)
    assert policy.targets(torch.tensor([1, 4, 1000])).tolist() == [1, 1, 1]
    assert H2O(kept_fraction=0.1, window=0).targets(torch.tensor([30, 31])).tolist() == [3, 4]


def test_a_numpy_fraction_is_the_fraction_it_holds():
    """Review 15: H2O(kept_fraction=np.int64(1)) was refused as "expected a number in (0, 1], got np.int64(1)"
    while the int 1 is taken; and a Fraction past a float's range raised a bare OverflowError."""
    from fractions import Fraction

    import numpy as np
    from qkmla.cache.eviction import H2O

    assert H2O(kept_fraction=np.int64(1), window=2).fraction == H2O(kept_fraction=1, window=2).fraction == 1
    assert H2O(kept_fraction=np.float32(0.5)).fraction == Fraction(1, 2)
    for bad in (Fraction(10 ** 400), np.int64(2), np.True_):
        with pytest.raises(ValueError, match=r"^kept_fraction: expected a number in \(0, 1\]"):
            H2O(kept_fraction=bad)
