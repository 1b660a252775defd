"""Where a cache keeps its per-token rows: contiguous or paged.

Attention code never touches storage directly: a cache writes rows at (sequence,
position) pairs and reads back a dense [B, S, width] view. A layout decides how the
rows sit in memory:

* :class:`ContiguousLayout`: one [B, capacity, width] tensor per field (gpt-fast style).
* :class:`PagedLayout`: a pool [num_blocks, block_size, width] per field plus one block
  table [B, blocks_per_seq] shared by every field of the cache (vLLM / FlashMLA style),
  so a fused kernel can walk the same table for the latent and the scalar pools.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from ..utils.checked import Frozen, as_int
from ..config import check_positive_int
from ..utils.limits import check_allocation


def written_only_in_inference_mode(t: torch.Tensor) -> bool:
    """Whether ``t`` was made under ``torch.inference_mode()`` and this code runs outside it, where torch refuses
    to write it ("Inplace update to inference tensor outside InferenceMode"). False while torch.compile traces:
    dynamo cannot read the flag."""
    return not torch.compiler.is_compiling() and t.is_inference() and not torch.is_inference_mode_enabled()


def inference_only(action: str = "decode with it") -> str:
    """The refusal of a write, outside inference mode, to buffers made under it (``action``: what to do inside)."""
    return (f"cache: its buffers were made under torch.inference_mode(), and torch lets only code inside "
            f"inference_mode write them; {action} inside torch.inference_mode() (torch.no_grad() is not "
            f"enough), or start again with cache.reset() outside torch.inference_mode(), or a new cache")


INFERENCE_ONLY = inference_only()


def renew(owner, name: str) -> bool:
    """``owner.<name>`` (a tensor) made writable for a cache's next sequence; True if it is a new tensor:
    * rows written by a forward with gradients on make the whole tensor a node of that forward's graph, so
      the next step's writes chained onto it, and its backward failed with "Trying to backward through the
      graph a second time": the history is dropped in place (the tensor keeps its address; out of inference
      mode for the call, in which detach_ leaves grad_fn as it was);
    * a tensor made under ``torch.inference_mode()`` can be written only inside it: outside, a new normal
      tensor of zeros, the old one released first (a reset reads none of the old values, and a copy held
      both at once: twice the cache's memory at the peak).
    While torch.compile traces, nothing (dynamo cannot read grad_fn or the inference flag)."""
    t = getattr(owner, name)
    if t is None or torch.compiler.is_compiling():
        return False
    if written_only_in_inference_mode(t):
        shape, dtype, device = t.shape, t.dtype, t.device
        setattr(owner, name, None)
        del t
        setattr(owner, name, torch.zeros(shape, dtype=dtype, device=device))
        return True
    if t.grad_fn is not None:
        with torch.inference_mode(False):
            t.detach_()
    return False


class TokenBuffer(ABC):
    """One field of a cache: a row of ``width`` values for each (sequence, position)."""

    width: int
    capacity: int
    element_size: int

    @abstractmethod
    def write(self, batch_idx: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows [N, width] at (batch_idx[n], positions[n]) for n < N."""

    @abstractmethod
    def gather(self, batch_idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rows [N, width] at (batch_idx[n], positions[n]), copied, in the stored dtype."""

    def write_span(self, start: int, rows: torch.Tensor) -> None:
        """Store rows [B, T, width] at positions start..start+T-1 of every sequence."""
        B, T = rows.shape[:2]
        batch_idx = torch.arange(B, device=rows.device).repeat_interleave(T)
        positions = torch.arange(start, start + T, device=rows.device).repeat(B)
        self.write(batch_idx, positions, rows.reshape(B * T, -1))

    @abstractmethod
    def read(self, length: int) -> torch.Tensor:
        """The first ``length`` positions of every sequence, [B, length, width]."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes allocated for this field."""

    storage_name = "data"  # the attribute holding the tensor every row lives in (a subclass's own: None)

    def storage(self) -> Optional[torch.Tensor]:
        """The tensor every row lives in; None for a buffer of another design (no ``storage_name`` tensor)."""
        t = getattr(self, self.storage_name, None)
        return t if isinstance(t, torch.Tensor) else None

    def forget_history(self) -> None:
        """The storage made writable again for the next sequence (:func:`renew`): without the autograd history
        a training step's rows gave it, and, outside inference mode, no longer an inference tensor (then new,
        zeros: its rows are the sequences a reset forgets). A buffer of another design is left as it is."""
        if self.storage() is not None:
            renew(self, self.storage_name)


class ContiguousBuffer(TokenBuffer):
    def __init__(self, batch_size: int, capacity: int, width: int, dtype: torch.dtype,
                 device=None, fill: float = 0.0):
        self.width, self.capacity, self.fill = width, capacity, fill
        check_allocation("capacity", batch_size * capacity * width * dtype.itemsize,
                         f"{batch_size} sequence(s) of capacity={capacity} tokens x {width} {dtype} values", device)
        self.data = torch.full((batch_size, capacity, width), fill, dtype=dtype, device=device)
        self.element_size = self.data.element_size()

    def select(self, batch_idx: torch.Tensor) -> None:
        """Keep sequences ``batch_idx`` [B'] in that order (a sequence may repeat): beam search's reorder."""
        self.data = self.data.index_select(0, batch_idx.to(self.data.device))

    def resize(self, capacity: int, length: int) -> None:
        """A new buffer of ``capacity`` slots holding the first ``length`` slots of each sequence."""
        data = torch.full((self.data.shape[0], capacity, self.width), self.fill, dtype=self.data.dtype,
                          device=self.data.device)
        data[:, :length] = self.data[:, :length]
        self.data, self.capacity = data, capacity

    def write(self, batch_idx, positions, rows):
        self.data[batch_idx, positions] = rows.to(self.data.dtype)

    def gather(self, batch_idx, positions):
        return self.data[batch_idx, positions]

    def write_span(self, start, rows):  # one strided copy, no index tensors
        self.data[:, start:start + rows.shape[1]] = rows

    def read(self, length):
        return self.data[:, :length]

    @property
    def nbytes(self):
        return self.data.numel() * self.data.element_size()


class PagedBuffer(TokenBuffer):
    """A pool of blocks [num_blocks, block_size, width] addressed through a block table."""

    storage_name = "pool"

    def __init__(self, block_table: torch.Tensor, num_blocks: int, block_size: int, width: int,
                 dtype: torch.dtype, device=None, fill: float = 0.0, num_blocks_given: bool = False,
                 table_given: bool = True):
        self.width, self.block_size = width, block_size
        self.block_table = block_table
        self.capacity = block_table.shape[1] * block_size
        # Name what makes the pool too big: one block past memory is block_size's doing; otherwise
        # the block count: num_blocks where the caller gave it, else the table's largest id, which sets it.
        check_allocation("block_size", block_size * width * dtype.itemsize,
                         f"one block of block_size={block_size} tokens x {width} {dtype} values", device)
        if num_blocks_given:
            name, what = "num_blocks", f"a pool of num_blocks={num_blocks} blocks"
        elif not table_given:  # the default table's blocks: as many as the capacity needs
            name, what = "capacity", f"a pool of {num_blocks} blocks (capacity={self.capacity} per sequence)"
        else:
            name, what = "block_table", f"a pool of num_blocks={num_blocks} blocks (one more than the largest block id)"
        check_allocation(name, num_blocks * block_size * width * dtype.itemsize,
                         f"{what} of {block_size} tokens x {width} {dtype} values", device)
        self.pool = torch.full((num_blocks, block_size, width), fill, dtype=dtype, device=device)
        self.element_size = self.pool.element_size()

    def _locate(self, batch_idx, positions):
        """(block id, row within the block) of each (sequence, slot)."""
        return self.block_table[batch_idx, positions // self.block_size], positions % self.block_size

    def write(self, batch_idx, positions, rows):
        self.pool[self._locate(batch_idx, positions)] = rows.to(self.pool.dtype)

    def gather(self, batch_idx, positions):
        return self.pool[self._locate(batch_idx, positions)]

    def read(self, length):
        n = -(-length // self.block_size)
        blocks = self.pool[self.block_table[:, :n]]  # [B, n, block_size, width]
        return blocks.flatten(1, 2)[:, :length]

    @property
    def nbytes(self):
        return self.pool.numel() * self.pool.element_size()


class Layout(ABC):
    """Makes the buffers of one cache; all buffers of a cache share one layout object."""

    @abstractmethod
    def buffer(self, batch_size: int, capacity: int, width: int, dtype: torch.dtype, device=None,
               fill: float = 0.0) -> TokenBuffer:
        ...


class ContiguousLayout(Layout):
    def buffer(self, batch_size, capacity, width, dtype, device=None, fill=0.0):
        return ContiguousBuffer(batch_size, capacity, width, dtype, device, fill)

    def __repr__(self) -> str:
        return "ContiguousLayout()"


class PagedLayout(Layout, Frozen):
    """Paged storage with a fixed block table.

    Args:
        block_size: tokens per block.
        block_table: [B, blocks_per_seq] block ids; by default sequence b owns blocks
            b * blocks_per_seq ... in order. Pass a permuted table to place blocks anywhere.
        num_blocks: pool size; by default one more than the largest id in the table.

    Fixed once made (:class:`~qkmla.utils.checked.Frozen`): ``layout.block_size = 0`` raises
    instead of skipping the constructor's checks. Without a ``block_table``, each cache that uses the
    layout gets the default table of its own batch size and capacity (and, without ``num_blocks``, a
    pool of that table's size); ``block_table`` and ``num_blocks`` then show the last cache's.
    """

    def __init__(self, block_size: int = 64, block_table: Optional[torch.Tensor] = None,
                 num_blocks: Optional[int] = None):
        # Past int64 as well (block_size=2**70 was taken, and refused only by the first cache using it). A NumPy int
        # is a size, as for the caches (np.int64(4) was refused as "expected a positive int, got np.int64(4)").
        block_size, num_blocks = as_int(block_size), as_int(num_blocks)
        check_positive_int("block_size", block_size)
        try:
            check_positive_int("num_blocks", num_blocks, allow_none=True)
        except ValueError as e:
            raise ValueError(f"{e} (None: one more than the largest block id)") from None
        self.block_size, self.block_table, self.num_blocks = block_size, block_table, num_blocks
        self._num_blocks_given = num_blocks is not None  # else each cache sets it from its table
        self._table_given = block_table is not None  # else each cache gets the default table of its shape

    def _given_table(self) -> bool:
        """Whether the caller gave ``block_table``. A layout pickled before ``_table_given`` existed: a table it
        holds was given, or filled in by a cache of the same shape, which the default table reproduces (so
        either reading loads the same rows); one answer, for the table and for the buffer's messages alike."""
        return getattr(self, "_table_given", self.block_table is not None)

    def _table(self, batch_size: int, capacity: int, device, table_given: bool) -> torch.Tensor:
        if not table_given:
            self._default_table(batch_size, capacity, device)
        table = self.block_table
        if not isinstance(table, torch.Tensor) or table.dtype.is_floating_point or table.dtype.is_complex \
                or table.dtype == torch.bool:
            got = table.dtype if isinstance(table, torch.Tensor) else type(table).__name__
            raise ValueError(f"block_table: expected an integer tensor of block ids, got {got}")
        if table.is_meta:  # its ids are read below: "Tensor.item() cannot be called on meta tensors"
            raise ValueError("block_table: on the meta device (shapes only), so it holds no block ids; pass it on the "
                             "cpu (the cache moves its own copy to its device)")
        if table.dim() != 2 or table.shape[0] != batch_size:
            raise ValueError(f"block_table: expected shape [batch_size={batch_size}, blocks_per_seq], "
                             f"got {tuple(table.shape)}")
        if table.shape[1] * self.block_size < capacity:
            raise ValueError(f"block_table: {table.shape[1]} blocks of {self.block_size} tokens hold fewer "
                             f"than capacity={capacity} tokens")
        # Every block is written by the one sequence that owns it: a negative id would index
        # from the pool's end, and a block listed twice would hold two sequences' rows.
        if int(table.min()) < 0:
            raise ValueError(f"block_table: block ids must be >= 0, got {int(table.min())}")
        ids, counts = table.flatten().unique(return_counts=True)
        if bool((counts > 1).any()):
            shared = ids[counts > 1][:4].tolist()
            raise ValueError(f"block_table: each block belongs to one sequence slot, but block(s) {shared} are "
                             f"listed more than once")
        if self.num_blocks is None:
            object.__setattr__(self, "num_blocks", int(table.max()) + 1)
        elif int(table.max()) >= self.num_blocks:
            raise ValueError(f"block_table: holds block id {int(table.max())}, but num_blocks={self.num_blocks}")
        return table.to(device=device, dtype=torch.long, copy=True)  # the cache's own: a later edit cannot move it

    def _default_table(self, batch_size: int, capacity: int, device) -> None:
        """Sequence b owns blocks b * per_seq ... in order, for this cache's batch and capacity. The default was
        filled in once, by the first cache, and kept for later ones: one PagedLayout() handed to a cache of another
        batch size or capacity was refused naming block_table ("expected shape [batch_size=3, blocks_per_seq],
        got (2, 2)"), a table the caller never gave."""
        per_seq = -(-capacity // self.block_size)
        check_allocation("capacity", 8 * batch_size * per_seq, f"a block table of {batch_size} x {per_seq} ids")
        if self._num_blocks_given and batch_size * per_seq > self.num_blocks:
            raise ValueError(f"num_blocks: the default block table of batch_size={batch_size} sequences x "
                             f"ceil(capacity={capacity} / block_size={self.block_size}) = {batch_size * per_seq} "
                             f"blocks needs num_blocks >= {batch_size * per_seq}, got {self.num_blocks}; pass a larger "
                             f"num_blocks, None, or a block_table of your own")
        # Not settings: what the last cache got, for a caller that reads them (the cache keeps its own copy)
        # On the CPU for a cache on the meta device, whose ids the checks read (the cache keeps a copy on its own)
        where = "cpu" if torch.device(device if device is not None else "cpu").type == "meta" else device
        object.__setattr__(self, "block_table",
                           torch.arange(batch_size * per_seq, device=where).view(batch_size, per_seq))
        if not self._num_blocks_given:
            object.__setattr__(self, "num_blocks", batch_size * per_seq)

    def buffer(self, batch_size, capacity, width, dtype, device=None, fill=0.0):
        table_given = self._given_table()
        table = self._table(batch_size, capacity, device, table_given)
        return PagedBuffer(table, self.num_blocks, self.block_size, width, dtype, device, fill, self._num_blocks_given,
                           table_given)

    def __repr__(self) -> str:
        return f"PagedLayout(block_size={self.block_size}, num_blocks={self.num_blocks})"
