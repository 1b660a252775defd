"""cache.keep: kept tokens move to the front of their sequence, every field together, bit for
bit, in either layout; slots shrink while RoPE positions keep counting."""

import pytest
import torch

from qkmla import LatentCache, PagedLayout
from qkmla.cache.latent import LatentCodec

D_C, D_R, G = 6, 4, 3


class ExtraFieldCodec(LatentCodec):
    """A codec with a third field of its own dtype (as a quantized format adds scales)."""

    def fields(self, kv_lora_rank, qk_rope_head_dim, num_kv_groups, dtype, scalar_dtype):
        return {**super().fields(kv_lora_rank, qk_rope_head_dim, num_kv_groups, dtype, scalar_dtype),
                "extra": (2, torch.bfloat16)}

    def store(self, c_kv, k_rope, key_scale):
        return {**super().store(c_kv, k_rope, key_scale), "extra": c_kv[..., :2]}


class ExtraFieldCache(LatentCache):
    codec = ExtraFieldCodec()


def layout(kind: str, B: int, capacity: int, block_size: int = 4):
    if kind == "contiguous":
        return None
    per_seq = -(-capacity // block_size)
    return PagedLayout(block_size, block_table=torch.randperm(B * per_seq).view(B, per_seq))  # shuffled blocks


def filled_cache(kind: str, lengths: list[int], capacity: int = 16, cls=LatentCache) -> tuple:
    """A cache holding random rows for sequences of ``lengths`` (NaN in every unwritten slot),
    and the rows as written, per field [B, T, width]."""
    B, T = len(lengths), max(lengths)
    cache = cls(B, capacity, D_C, D_R, G, dtype=torch.float64, scalar_dtype=torch.float32,
                layout=layout(kind, B, capacity), fill=float("nan"))
    slot = cache.plan(B, T, input_lengths=torch.tensor(lengths))
    cache.append(slot, c_kv=torch.randn(B, T, D_C, dtype=torch.float64),
                 k_rope=torch.randn(B, T, D_R, dtype=torch.float64),
                 key_scale=torch.rand(B, T, G) + 0.5)
    return cache, {name: cache.read(name).clone() for name in cache.fields}


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_kept_rows_move_to_the_front_bit_for_bit(kind):
    """Uneven lengths 9, 4, 0, 7; each sequence keeps its own set (lengths differ after);
    every field, the codec's own included, moves with its token, unchanged to the bit."""
    lengths = [9, 4, 0, 7]
    cache, before = filled_cache(kind, lengths, cls=ExtraFieldCache)
    keep = [[0, 1, 5, 8], [2, 3], [], [0, 1, 2, 3, 4, 5, 6]]
    mask = torch.zeros(4, 9, dtype=torch.bool)
    for b, slots in enumerate(keep):
        mask[b, slots] = True
    order = cache.keep(mask)
    assert cache.seqlens.tolist() == [4, 2, 0, 7] and cache.max_len == 7 and not cache.uniform
    assert cache.next_positions.tolist() == lengths  # positions keep counting
    for b, slots in enumerate(keep):
        assert order[b, :len(slots)].tolist() == slots
        for name, rows in before.items():
            got = cache.read(name)[b, :len(slots)]
            assert torch.equal(got.view(torch.uint8), rows[b, slots].view(torch.uint8)), (name, b)
        assert cache.slot_positions()[b, :len(slots)].tolist() == slots
    assert set(cache.fields) == {"latent", "key_scale", "extra"}


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_new_tokens_fill_the_freed_slots_at_the_next_positions(kind):
    cache, before = filled_cache(kind, [6, 6], capacity=8)
    cache.keep(torch.tensor([[1, 0, 0, 1, 0, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool))
    slot = cache.plan(2, 2)
    assert slot.slots.tolist() == [[3, 4], [6, 7]] and slot.positions.tolist() == [[6, 7], [6, 7]]
    new = torch.randn(2, 2, D_C, dtype=torch.float64)
    cache.append(slot, c_kv=new, k_rope=torch.zeros(2, 2, D_R, dtype=torch.float64), key_scale=torch.ones(2, 2, G))
    positions = cache.slot_positions()
    assert positions[0, :5].tolist() == [0, 3, 5, 6, 7] and positions[1].tolist() == list(range(8))
    latent = cache.read("latent")
    assert torch.equal(latent[0, :3], before["latent"][0, [0, 3, 5]]) and torch.equal(latent[0, 3:5, :D_C], new[0])
    assert not torch.isnan(latent[0, :5]).any() and latent[0, 5:].eq(0).all()  # past its length: read as 0


def test_a_second_compaction_keeps_the_recorded_positions():
    cache, _ = filled_cache("contiguous", [8])
    cache.keep(torch.tensor([[1, 0, 1, 0, 1, 0, 1, 1]], dtype=torch.bool))  # positions 0 2 4 6 7
    cache.append(cache.plan(1, 2), c_kv=torch.zeros(1, 2, D_C), k_rope=torch.zeros(1, 2, D_R),
                 key_scale=torch.ones(1, 2, G))  # positions 8 9 at slots 5 6
    cache.keep(torch.tensor([[0, 1, 0, 1, 1, 0, 1]], dtype=torch.bool))
    assert cache.slot_positions().tolist() == [[2, 6, 7, 9]] and cache.next_positions.tolist() == [10]
    cache.restart_positions()
    assert cache.slot_positions().tolist() == [[0, 1, 2, 3]] and cache.next_positions.tolist() == [4]


def test_keep_everything_changes_nothing():
    cache, before = filled_cache("paged", [5, 3])
    order = cache.keep(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool))
    assert order[0].tolist() == [0, 1, 2, 3, 4]
    for name, rows in before.items():
        torch.testing.assert_close(cache.read(name), rows, rtol=0, atol=0)
    assert cache.seqlens.tolist() == [5, 3] and cache.slot_positions()[0].tolist() == [0, 1, 2, 3, 4]


def test_reset_forgets_the_recorded_positions():
    cache, _ = filled_cache("contiguous", [4])
    cache.keep(torch.tensor([[0, 0, 1, 1]], dtype=torch.bool))
    cache.reset()
    cache.append(cache.plan(1, 3), c_kv=torch.zeros(1, 3, D_C), k_rope=torch.zeros(1, 3, D_R),
                 key_scale=torch.ones(1, 3, G))
    assert cache.slot_positions().tolist() == [[0, 1, 2]]


def test_keep_checks_its_mask():
    cache, _ = filled_cache("contiguous", [4, 2])
    with pytest.raises(ValueError, match=r"mask: expected a bool tensor \[batch_size=2, max_len=4\], got torch.int64"):
        cache.keep(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"mask: expected a bool tensor \[batch_size=2, max_len=4\], got torch.bool"):
        cache.keep(torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask: keeps a slot past its sequence's length \(seqlens \[4, 2\]\)"):
        cache.keep(torch.ones(2, 4, dtype=torch.bool))
    assert cache.seqlens.tolist() == [4, 2]
