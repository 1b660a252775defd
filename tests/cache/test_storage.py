import pytest
import torch

from qkmla.cache.storage import ContiguousLayout, PagedLayout


def write_some(buf):
    batch_idx = torch.tensor([0, 0, 1, 2, 2, 2])
    positions = torch.tensor([0, 1, 0, 0, 1, 2])
    rows = torch.arange(6, dtype=torch.float32)[:, None].expand(6, 3) + 1
    buf.write(batch_idx, positions, rows)
    return rows


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_paged_reads_like_contiguous(block_size):
    contiguous = ContiguousLayout().buffer(3, 8, 3, torch.float32, fill=float("nan"))
    table = torch.randperm(3 * (8 // block_size)).view(3, -1)
    paged = PagedLayout(block_size, block_table=table).buffer(3, 8, 3, torch.float32, fill=float("nan"))
    write_some(contiguous)
    write_some(paged)
    torch.testing.assert_close(paged.read(3), contiguous.read(3), equal_nan=True)
    assert paged.read(3)[0, 1, 0] == 2 and torch.isnan(paged.read(3)[1, 1]).all()


def test_paged_block_table_is_checked():
    with pytest.raises(ValueError, match="block_table"):
        PagedLayout(4, block_table=torch.zeros(2, 1, dtype=torch.long)).buffer(2, 8, 3, torch.float32)
    with pytest.raises(ValueError, match="block_table"):
        PagedLayout(4, block_table=torch.zeros(3, 2, dtype=torch.long)).buffer(2, 8, 3, torch.float32)
    with pytest.raises(ValueError, match="num_blocks"):
        PagedLayout(4, block_table=torch.arange(4).view(2, 2), num_blocks=3).buffer(2, 8, 3, torch.float32)
    with pytest.raises(ValueError, match="block_size"):
        PagedLayout(0)


def test_bytes():
    buf = ContiguousLayout().buffer(2, 10, 5, torch.bfloat16)
    assert buf.nbytes == 2 * 10 * 5 * 2
    paged = PagedLayout(4).buffer(2, 10, 5, torch.float32)  # 3 blocks of 4 per sequence
    assert paged.nbytes == 6 * 4 * 5 * 4


@pytest.mark.parametrize("table,message", [
    (torch.tensor([[0, 1], [1, 2]]), r"block\(s\) \[1\] are listed more than once"),
    (torch.tensor([[0, 0], [1, 2]]), r"block\(s\) \[0\] are listed more than once"),
    (torch.tensor([[0, -1], [2, 3]]), "block ids must be >= 0, got -1"),
    (torch.tensor([[0.0, 1.0], [2.0, 3.0]]), "expected an integer tensor of block ids"),
])
def test_a_block_table_that_would_mix_sequences_is_refused(table, message):
    """Issue 27, class 3: a block two sequences share, or a negative id (which would index from
    the pool's end), would let one sequence's writes land in another's rows."""
    with pytest.raises(ValueError, match=message):
        PagedLayout(4, block_table=table).buffer(2, 8, 3, torch.float32)


def test_the_decode_op_refuses_block_ids_outside_the_pool():
    from qkmla.ops.mla_decode import mla_decode_with_kvcache

    q_lat, q_rope = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 8)
    pool = torch.randn(4, 4, 24)
    for backend in ("torch", "naive"):
        for table in (torch.tensor([[0, 1], [-1, 3]]), torch.tensor([[0, 1], [2, 4]])):
            with pytest.raises(ValueError, match="block_table: "):
                mla_decode_with_kvcache(q_lat, q_rope, pool, table, torch.tensor([8, 8]), softmax_scale=0.3,
                                        backend=backend)


def test_the_cache_keeps_its_own_copy_of_the_block_table():
    table = torch.tensor([[0, 1], [2, 3]])
    buf = PagedLayout(4, block_table=table).buffer(2, 8, 3, torch.float32)
    table[0, 0] = 3  # an edit afterwards would make sequence 0 write into sequence 1's block
    assert buf.block_table.tolist() == [[0, 1], [2, 3]]


def test_the_decode_op_refuses_lengths_past_the_capacity():
    """Issue 27, class 3: a slice past the capacity held fewer slots than the lengths claimed,
    and the op attended over those silently."""
    from qkmla.ops.mla_decode import mla_decode_with_kvcache

    q_lat, q_rope = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 4, 8)
    for backend in ("torch", "naive"):
        for lengths in ([6, 9], [3, -1]):
            with pytest.raises(ValueError, match=r"cache_seqlens: expected lengths in \[0, 6\]"):
                mla_decode_with_kvcache(q_lat, q_rope, torch.randn(2, 6, 24), None, torch.tensor(lengths),
                                        softmax_scale=0.3, backend=backend)


def test_a_layout_pickled_before_table_given_reads_one_answer_for_table_and_pool():
    """A PagedLayout pickled before ``_table_given`` existed, holding no table: the table was made by default
    but the pool's memory refusal named ``block_table`` (a table the caller never gave), the two reading
    "given" with two different fallbacks. Now one answer: the refusal names ``capacity``, as for a new one."""
    import pickle

    def pickled_before_table_given():
        layout = PagedLayout(2**16)
        del layout.__dict__["_table_given"]
        return pickle.loads(pickle.dumps(layout))

    for make in (PagedLayout, pickled_before_table_given):  # a small table (2 x 1024 ids) of a pool past memory
        layout = PagedLayout(2**16) if make is PagedLayout else make()
        with pytest.raises(ValueError, match=r"^capacity: .*a pool of"):
            layout.buffer(2, 2**26, 1024, torch.float32)
        layout = PagedLayout(2**16) if make is PagedLayout else make()
        assert layout.buffer(2, 10, 5, torch.float32).capacity == 2**16
