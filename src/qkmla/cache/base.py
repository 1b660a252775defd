"""Per-sequence bookkeeping shared by every cache: lengths, slots, positions, masks, bytes.

A cache holds a batch of B sequences. Each token has a *slot* (where its row is stored;
sequence b fills slots 0..seqlens[b]-1 in order, and attention reads slots) and a
*position* (its RoPE position, already applied to a cached key). Until tokens are dropped a
token's slot is its position; they are tracked apart (``seqlens`` and ``next_positions``, both [B]) so a
policy that drops cached tokens can compact the slots while new tokens keep counting
positions, without touching attention code. :meth:`SequenceCache.keep` is that compaction;
:meth:`SequenceCache.slot_positions` says which position each slot's token has.

A forward pass with T new tokens per sequence asks :meth:`SequenceCache.plan` where they
go; the plan checks capacity and any positions the caller passed, then the module
computes its rows and the cache stores them (``LatentCache.append``,
``FullKVCache.update``). Right-padded batches pass ``input_lengths`` [B]: only the first
``input_lengths[b]`` of sequence b's T tokens are stored, so prompts of different lengths
share one prefill call.
"""

from __future__ import annotations

import contextlib
import copy
import math
import secrets
from dataclasses import dataclass, field, fields, replace
from typing import Iterator, Optional

import torch

from ..utils.checked import INT64_MAX, _constructed, _constructing, as_int, as_number, check_size, is_int, is_number
from ..utils.devices import check_device
from ..utils.limits import check_allocation

from .storage import (INFERENCE_ONLY, ContiguousBuffer, ContiguousLayout, Layout, TokenBuffer, inference_only,
                      written_only_in_inference_mode)


# The attribute an attention layer is known by to the cache it writes (SequenceCache.check_writer).
WRITER_TOKEN = "_qkmla_cache_writer"


def _watch(tensors) -> tuple:
    """((tensor, its version counter, a copy, or None), ...): None for None. Inference tensors keep no version
    counter: on the CPU a copy of their values stands in (comparing it is free there, and they are a few [B, T]
    ints; an edit in place under torch.inference_mode, slot.slots[0, 0] = 4, was written as edited, without a word),
    elsewhere None (comparing values would wait for the device at every write)."""
    def mark(t):
        if t is None:
            return None
        if not t.is_inference():
            return t._version
        return t.clone() if t.device.type == "cpu" else None

    return tuple((t, mark(t)) for t in tensors)


def _unchanged(planned: tuple, now: tuple) -> bool:
    """Whether ``now``'s tensors are ``planned``'s, by identity, and none was written since (where counted, or by
    value against the copy :func:`_watch` took)."""
    return all(t is n and (v is None or (torch.equal(n, v) if isinstance(v, torch.Tensor) else n._version == v))
               for (t, v), n in zip(planned, now))


# Frozen: slot.slots = ... or slot.max_len = ... between plan() and append() was written as edited (max_len and
# uniform taken as the cache's own). dataclasses.replace of positions (rope_positions) is the one edit meant:
# ``planned`` watches the tensors a write reads.
@dataclass(frozen=True)
class WriteSlot:
    """Where T new tokens of each sequence go.

    slots: [B, T] the slots the new tokens' rows are written to.
    positions: [B, T] the new tokens' RoPE positions.
    valid: [B, T] bool, False for right padding; None when every token is real.
    seqlens: [B] filled slots after the write.
    next_positions: [B] the position of each sequence's next token after the write.
    max_len: max(seqlens), as a Python int.
    uniform: whether every sequence has the same length after the write.
    planned: the tensors a write reads (slots, valid, seqlens, next_positions) and the cache's own
        seqlens and next_positions at plan time, each with its version counter (under inference_mode,
        whose tensors keep none, a copy of their values on the CPU, nothing elsewhere): append refuses a
        slot whose tensors were replaced (dataclasses.replace) or edited in place, a slot of another
        cache, and a cache whose lengths changed since, by identity and counters, reading no value
        but the CPU copies'.
    """

    slots: torch.Tensor
    positions: torch.Tensor
    valid: Optional[torch.Tensor]
    seqlens: torch.Tensor
    next_positions: torch.Tensor
    max_len: int
    uniform: bool
    planned: tuple = field(default=(), compare=False, repr=False)

    def watched(self, cache: "SequenceCache") -> tuple:
        """The tensors :attr:`planned` records, as they are now (``cache``: the one writing)."""
        return self.slots, self.valid, self.seqlens, self.next_positions, cache.seqlens, cache.next_positions

    def __deepcopy__(self, memo):
        # Copied tensors start new version counters (deepcopy gives 1): the copy watches its own tensors as copied
        values = {f.name: copy.deepcopy(getattr(self, f.name), memo) for f in fields(self) if f.name != "planned"}
        return WriteSlot(**values, planned=_watch([copy.deepcopy(t, memo) for t, _ in self.planned]))

    def key_mask(self) -> Optional[torch.Tensor]:
        """[B, T, max_len] bool: slot j is visible to new token t of sequence b.

        None when no mask is needed: a single new token per sequence and equal lengths,
        which is the steady state of batched decoding.
        """
        T = self.slots.shape[1]
        if T == 1 and self.uniform:
            return None
        j = torch.arange(self.max_len, device=self.slots.device)
        return (j <= self.slots[..., None]) & (j < self.seqlens[:, None, None])

    def visible_lens(self) -> Optional[torch.Tensor]:
        """[B, T]: slots new token t of sequence b sees, as the decode op's ``visible_lens``;
        None where the op's default (causal among the new tokens) is the same."""
        return self.slots + 1 if self.valid is not None else None


def check_dims(allow_zero: tuple = (), **dims) -> None:
    """Every width is a positive int (or >= 0 for the names in ``allow_zero``); callers pass them
    through :func:`~qkmla.utils.checked.as_int` first (a NumPy int is an int)."""
    for name, v in dims.items():
        low = 0 if name in allow_zero else 1
        if not is_int(v) or v < low:
            raise ValueError(f"{name}: expected an int >= {low}, got {v!r}")


def check_row_widths(batch_size: int, itemsize: int, device, **widths) -> None:
    """ValueError naming the width whose one token's values, for one sequence, alone exceed the memory:
    ``LatentCache(1, 4, kv_lora_rank=2**40, ...)`` was refused naming ``capacity`` ("capacity=4 tokens x
    1099511627784 values ... use a smaller value"), the one size that was fine. A width that fits one
    sequence is left to the whole buffer's check (a batch of 2**26 was blamed on head_dim=512)."""
    for name, width in widths.items():
        check_allocation(name, width * itemsize, f"one token's {name}={width} values", device)


def config_fields(config, names: tuple, expected: str) -> tuple:
    """``config``'s fields ``names``, or a ValueError naming config (``expected``: the configs that have them):
    LatentCache.from_config(AttentionConfig(...)) failed with "AttributeError: 'AttentionConfig' object has no
    attribute 'kv_lora_rank'", FullKVCache.from_config("x") with "'str' object has no attribute ..."."""
    missing = next((name for name in names if not hasattr(config, name)), None)
    if missing is not None:
        raise ValueError(f"config: expected {expected}, got {type(config).__name__} (it has no {missing})")
    return tuple(getattr(config, name) for name in names)


def check_dtype(name: str, dtype) -> None:
    """Cached rows are floating point (an integer buffer would truncate them silently)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating-point torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    if dtype.itemsize == 1:  # float8 without a scale: a silent loss of everything below 2^-6 or past 448
        raise ValueError(f"{name}: expected a floating-point dtype of 2 bytes or more, got {dtype}; an fp8 latent "
                         f"needs its per-tile scales: LatentCache(..., kv_format='fp8')")


def check_storable(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    """A ValueError naming ``name`` if float64 rows ``t`` hold finite values past ``dtype``'s range, which the cache
    stores in ``dtype``: a float32 cache given float64 rows of 1e40 read them back as inf, an fp8 / int8 / int4 one
    (float32 scales, a bfloat16 RoPE key) as NaN or inf, without a word. Only float64 rows are read (a reference
    computation's): a decode step in float32 or narrower waits for no read of its values (:meth:`check_slot`)."""
    if t.dtype != torch.float64 or dtype == torch.float64 or t.is_meta or torch.compiler.is_compiling():
        return
    top = torch.finfo(dtype).max
    over = (t.abs() > top) & t.isfinite()
    if bool(over.any()):
        raise ValueError(f"{name}: holds float64 values past {dtype}'s range (largest {top:.6g}; got "
                         f"{float(t.abs()[over].max()):.6g}), which this cache stores in {dtype}; build a dense "
                         f"cache with dtype=torch.float64 for them")


def check_has_values(name: str, value, device) -> None:
    """A ValueError naming ``name`` for a tensor on the meta device (shapes only) handed to a cache that reads its
    values: copied to the cache's device, it failed with "Cannot copy out of meta tensor; no data!", naming nothing
    (select_sequences' indices, drop_last's counts, keep's mask, plan's positions, seqlens / next_positions set)."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        raise ValueError(f"{name}: on the meta device (shapes only), so it holds no values to read; pass it on "
                         f"{device} (the cache's device)")


def _integers(name: str, values, device, expected: str) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``; a ValueError naming ``name`` for floats, complex
    numbers or bools, which ``.long()`` would truncate or take as 0/1 without a word."""
    check_has_values(name, values, device)
    values = torch.as_tensor(values, device=device)
    if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
        raise ValueError(f"{name}: expected {expected}, got {values.dtype}")
    return values.long()


class SequenceCache:
    """Base of every cache: B sequences of at most ``capacity`` tokens, named fields.

    The sizes its buffers were allocated for (:attr:`FIXED`) are set by the constructor and by the
    methods that resize the buffers with them (:meth:`grow`, :meth:`select_sequences`); assigned
    from outside (``cache.capacity = 100``), they were taken at their word and the next write failed
    deep in torch (or a smaller one silently refused tokens the buffers hold room for)."""

    # eviction: the policy's state, sized for these buffers and this batch (a LatentCache(policy=...) sets it
    # once); assigned from outside (cache.eviction = None mid-decode, or another cache's), the next forward
    # failed deep in the evictor ("'str' object has no attribute 'after_attention'") or scored stale state.
    # fields: the buffers themselves (cache.fields = {} failed at the next read with KeyError: 'latent').
    FIXED = ("batch_size", "capacity", "device", "layout", "eviction", "fields")
    # Constructor arguments the cache reads once and keeps under no name of its own (a subclass lists its
    # own; a user's subclass inherits its base's, whatever its constructor's signature): set on a built
    # cache, they are refused (__setattr__), as nothing would read them.
    READ_ONCE: tuple = ()

    # The lengths bookkeeping (:meth:`advance` and the methods that drop or reorder tokens move it, through
    # _set_lengths). seqlens and next_positions may be set from outside (a caller that moved the positions on
    # as a policy that dropped tokens would) and are checked when they are: seqlens=[100] on a cache of
    # capacity 8, or [-3], was taken, and the next write went to slots the lengths did not say (or failed
    # deep in torch's indexing). max_len and uniform follow from seqlens, so they are not set alone.
    LENGTHS = ("seqlens", "next_positions")
    DERIVED = ("max_len", "uniform")

    def __setattr__(self, name, value):
        if name in self.__dict__ and name in self.DERIVED:
            raise AttributeError(f"{name}: follows from seqlens (max_len = max(seqlens), uniform: all equal); set "
                                 f"seqlens, or use drop_last(counts), keep(mask) or reset()")
        if name in self.__dict__ and name in self.LENGTHS:
            self._set_lengths(**{name: self._checked_lengths(name, value)})
            if name == "seqlens":
                lengths = self.seqlens
                self._set_lengths(max_len=int(lengths.max()), uniform=bool((lengths == lengths[0]).all()))
            return
        if name in type(self).READ_ONCE and name not in self.__dict__ and id(self) not in _constructing:
            # A constructor argument the cache reads once and keeps under no name of its own (policy, fill,
            # scalar_dtype; FullKVCache's dtype): cache.policy = H2O(...) on a built cache made a new attribute
            # that nothing reads, and decoding went on without eviction (probe14 A27).
            raise AttributeError(f"{name}: an argument of {type(self).__name__}(...), read once as the cache is made "
                                 f"(its buffers and state follow from it); set now, nothing would read it: make a "
                                 f"new cache with {name}=...")
        if name in type(self).FIXED and name in self.__dict__:
            how = {"capacity": "grow(capacity) raises it", "batch_size": "select_sequences(indices) changes it",
                   "device": "make a new cache on the device you want", "layout": "make a new cache with that layout",
                   "eviction": "pass policy= when you make the cache (LatentCache(..., policy=...))"}
            raise AttributeError(f"{name}: the cache's buffers are allocated for {name}={self.__dict__[name]!r:.80}; "
                                 f"{how.get(name, 'make a new cache with the value you want')}")
        object.__setattr__(self, name, value)

    def __init_subclass__(cls, **kwargs):
        # Each constructor marks the cache as under construction (utils.checked._constructing) while it runs,
        # so that __setattr__ tells its own first assignments from a caller's later ones.
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _constructed(cls.__dict__["__init__"])

    def _checked_lengths(self, name: str, value) -> torch.Tensor:
        """``value`` for ``cache.seqlens = value`` or ``cache.next_positions = value`` from outside, or a ValueError
        naming ``name``: [batch_size] integer token counts on the cache's device, seqlens within the capacity and
        at most next_positions (a token's position is never behind its slot)."""
        B = self.batch_size
        self.check_readable(name)
        if not isinstance(value, torch.Tensor) or value.shape != (B,) or value.dtype.is_floating_point \
                or value.dtype.is_complex or value.dtype == torch.bool:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"{value!r:.80}"
            raise ValueError(f"{name}: expected an integer tensor [batch_size={B}], got {got}")
        check_has_values(name, value, self.device)
        value = value.to(device=self.device, dtype=torch.long)
        seqlens = value if name == "seqlens" else self.seqlens
        positions = value if name == "next_positions" else self.next_positions
        if bool((seqlens < 0).any()) or bool((seqlens > self.capacity).any()):
            raise ValueError(f"{name}: expected seqlens in [0, capacity={self.capacity}], got {seqlens.tolist()}")
        if bool((positions < seqlens).any()) or bool((positions > INT64_MAX // 2).any()):
            raise ValueError(f"{name}: expected next_positions from seqlens {seqlens.tolist()} (a token's position is "
                             f"never behind its slot) to 2**62, got next_positions {positions.tolist()}; each is "
                             f"checked against the other's value now: restoring both, set the one this leaves "
                             f"consistent first (next_positions before a larger seqlens)")
        return value

    def check_readable(self, name: str) -> None:
        """A ValueError naming ``name`` when this cache is on the meta device (shapes only): the method reads
        ``name``'s values against the lengths, and failed with "Tensor.item() cannot be called on meta tensors"."""
        if self.device.type == "meta":
            raise ValueError(f"{name}: read by value against the cache's lengths, which a cache on the meta device "
                             f"(shapes only) does not hold; build the cache on the cpu or an accelerator")

    def _set_lengths(self, **values) -> None:
        for name, value in values.items():  # the cache's own moves: checked by the code that computes them
            object.__setattr__(self, name, value)

    def __copy__(self):
        # copy.copy gave a cache sharing the original's buffers with lengths of its own: a branch and the original
        # each wrote their next token to the same slot, and the branch then attended to the original's row (0.22 off
        # the reference), without a word
        raise TypeError(f"cache: copy.copy(cache) would share its buffers with the original while each keeps lengths "
                        f"of its own, so each would write over the other's next tokens; copy.deepcopy(cache) copies "
                        f"the {type(self).__name__} (a branch of a generation)")

    def __deepcopy__(self, memo):
        # Rows written by a forward with gradients on carry autograd history (a cache may be trained
        # through: test_mla), and torch refuses to deepcopy such a tensor with a message about weight_norm.
        # Said here, with the way out; a copy that dropped the history would train its branch silently wrong.
        held = [name for name, buf in self.fields.items()
                if any(t is not None and t.grad_fn is not None for t in (getattr(buf, "data", None),
                                                                        getattr(buf, "pool", None)))]
        if held:
            raise RuntimeError(f"cache: its {', '.join(held)} rows carry autograd history (written by a forward with "
                               f"gradients enabled), which copy.deepcopy cannot copy; fill the cache under "
                               f"torch.no_grad() to copy it (pickle keeps the values and drops the history)")
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            object.__setattr__(new, name, copy.deepcopy(value, memo))
        return new

    def __init__(self, batch_size: int, capacity: int, device=None, layout: Optional[Layout] = None):
        batch_size, capacity = as_int(batch_size), as_int(capacity)
        for name, value in (("batch_size", batch_size), ("capacity", capacity)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.batch_size, self.capacity = batch_size, capacity
        device = check_device("device", device, meta=True)
        # A Layout instance: the class itself (layout=ContiguousLayout) failed in a buffer's size
        # arithmetic, "unsupported operand type(s) for *: 'int' and 'torch.dtype'".
        if layout is not None and not isinstance(layout, Layout):
            raise ValueError(f"layout: expected a ContiguousLayout() or PagedLayout(...) instance, or None, got "
                             f"{layout!r:.80}")
        check_allocation("batch_size", 24 * batch_size, f"the lengths and positions of {batch_size} sequences",
                         device)
        self.layout = layout if layout is not None else ContiguousLayout()
        self.fields: dict[str, TokenBuffer] = {}
        self.seqlens = torch.zeros(batch_size, dtype=torch.long, device=device)
        # The device torch put the buffers on: "cuda" names the current one (cuda:0 or another), "cpu:0"
        # is "cpu", "mps" is "mps:0"; a forward compares it with its input's (check_cache_device).
        self.device = self.seqlens.device
        self.next_positions = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.max_len = 0
        self.uniform = True
        # Positions of the first kept_lens[b] slots, recorded by the last keep() (allocated by the
        # first); every later slot was appended since and sits at slot + next_positions - seqlens.
        self._kept_positions: Optional[torch.Tensor] = None
        self._kept_lens = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        self.eviction = None  # a cache that evicts (LatentCache(policy=...)) holds its policy's state here
        self.writer: Optional[int] = None  # the token of the layer whose rows it holds (check_writer)

    def _add_field(self, name: str, width: int, dtype: torch.dtype, fill: float) -> None:
        fill = as_number(fill)  # a NumPy number is the number it holds (np.float32(0.0) was refused as no number)
        # fill='x' failed in torch.full ("argument 'fill_value' must be Number, not str"), naming no argument
        if not is_number(fill):
            raise ValueError(f"fill: expected a number (the value of never-written slots, e.g. 0.0 or float('nan')), "
                             f"got {fill!r:.80}")
        # A finite fill past the dtype's range (1e6 in float16) failed in torch.full: "value cannot be converted to
        # type c10::Half without overflow", naming nothing (inf and NaN are values of every floating dtype)
        if dtype.is_floating_point and fill == fill and abs(fill) != math.inf \
                and abs(fill) > torch.finfo(dtype).max:  # fill == fill: not NaN (an int past a float's range too)
            raise ValueError(f"fill: {fill!r:.40} is past {dtype}'s range (largest {torch.finfo(dtype).max:g}); pass a "
                             f"value it holds, inf or NaN")
        self.fields[name] = self.layout.buffer(self.batch_size, self.capacity, width, dtype, self.device, fill)

    # -- writing -----------------------------------------------------------------------------

    def plan(self, batch_size: int, num_tokens: int, positions: Optional[torch.Tensor] = None,
             input_lengths: Optional[torch.Tensor] = None, *, writer: Optional[object] = None) -> WriteSlot:
        """Check and place ``num_tokens`` new tokens of each of ``batch_size`` sequences; ``writer``: the
        attention layer about to write them (:meth:`check_writer`)."""
        if writer is not None:
            self.check_writer(writer)
        self.check_writable()
        if isinstance(batch_size, bool):  # True == 1: plan(True, 1) was taken as a batch of one
            raise ValueError(f"batch_size: expected an int (x.shape[0]), got {batch_size!r}")
        if batch_size != self.batch_size:
            raise ValueError(f"x: batch of {batch_size} sequences does not match the cache, "
                             f"which holds batch_size={self.batch_size}")
        # num_tokens=-1 reached torch.arange ("upper bound and lower bound inconsistent with step sign")
        check_size("num_tokens", num_tokens, 0, " (the new tokens of each sequence)")
        if input_lengths is None:
            # Before the index tensors below, which are num_tokens long: plan(1, 2**40) reached torch's allocator
            self._check_capacity(self.max_len + num_tokens, num_tokens)
        start = self.seqlens
        steps = torch.arange(num_tokens, device=self.device)
        expected = self.next_positions[:, None] + steps
        if positions is not None:
            # A list or NumPy array failed here in ``.to`` ("'list' object has no attribute 'to'"); the
            # forward without a cache refuses them naming positions (default_positions), and so does this.
            if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point \
                    or positions.dtype.is_complex or positions.dtype == torch.bool:
                raise ValueError(f"positions: expected an integer tensor of shape [{batch_size}, {num_tokens}] or "
                                 f"[{num_tokens}], got {positions!r:.80}")
            check_has_values("positions", positions, self.device)
            positions = positions.to(self.device)
            # [1, T] too, as the forward without a cache takes them (default_positions) and as a host model's
            # position_ids come: arange(T)[None] for a batch of 2 was refused as not continuing the cached lengths
            if positions.shape in ((num_tokens,), (1, num_tokens)):
                positions = positions.expand(batch_size, num_tokens)
            if positions.shape != expected.shape:
                raise ValueError(f"positions: expected shape [{batch_size}, {num_tokens}], [1, {num_tokens}] or "
                                 f"[{num_tokens}], got {tuple(positions.shape)}")
            if not torch.equal(positions, expected):
                raise ValueError(
                    f"positions: a cached forward must continue each sequence at its cached length "
                    f"(cache lengths {self.next_positions.tolist()}), so positions must be seqlens[:, None] + "
                    f"arange(T); got positions starting at {positions[..., :1].flatten().tolist()}"
                )
        valid = None
        if input_lengths is None:
            added = torch.full_like(start, num_tokens)
            uniform = self.uniform
        else:
            self.check_readable("input_lengths")
            if isinstance(input_lengths, torch.Tensor) and input_lengths.is_meta:
                # copied to the cache's device below, which failed: "Cannot copy out of meta tensor; no data!"
                raise ValueError(f"input_lengths: on the meta device (shapes only), so they say no lengths; pass "
                                 f"them on {self.device} (the cache's device)")
            input_lengths = torch.as_tensor(input_lengths, device=self.device)
            if input_lengths.shape != (batch_size,) or input_lengths.dtype.is_floating_point \
                    or input_lengths.dtype in (torch.bool, torch.complex64, torch.complex128):
                raise ValueError(f"input_lengths: expected an integer tensor of shape [{batch_size}], "
                                 f"got {input_lengths.dtype} {tuple(input_lengths.shape)}")
            lo, hi = int(input_lengths.min()), int(input_lengths.max())
            if lo < 0 or hi > num_tokens:
                raise ValueError(f"input_lengths: expected values in [0, T={num_tokens}], got {input_lengths.tolist()}")
            added = input_lengths.long()
            valid = steps < added[:, None]
            uniform = bool((start + added == start[0] + added[0]).all())
        seqlens = start + added
        max_len = self.max_len + num_tokens if input_lengths is None else int(seqlens.max())
        self._check_capacity(max_len, num_tokens)
        slot = WriteSlot(slots=start[:, None] + steps, positions=expected, valid=valid, seqlens=seqlens,
                         next_positions=self.next_positions + added, max_len=max_len, uniform=uniform)
        return slot if torch.compiler.is_compiling() else replace(slot, planned=_watch(slot.watched(self)))

    def check_writable(self, action: str = "decode with it") -> None:
        """A ValueError naming cache when its buffers were made under ``torch.inference_mode()`` and this
        write is outside it: torch refuses it, deep in the write ("Inplace update to inference tensor
        outside InferenceMode is not allowed"), naming no cache and no way out; ``torch.no_grad()`` is
        not inference mode. ``action``: what the refusal says to do inside inference mode."""
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():  # first: dynamo cannot trace the rest
            return
        storages = (buf.storage() for buf in self.fields.values())
        if any(s is not None and written_only_in_inference_mode(s) for s in storages):
            raise ValueError(INFERENCE_ONLY if action == "decode with it" else inference_only(action))

    def _check_capacity(self, max_len: int, num_tokens: int) -> None:
        if max_len > self.capacity:
            raise ValueError(
                f"positions: writing {num_tokens} tokens would reach position {max_len - 1}, past the cache "
                f"capacity={self.capacity} (allowed positions 0..{self.capacity - 1}); allocate a larger cache"
            )

    def check_writer(self, writer: object) -> None:
        """A ValueError unless this cache is empty or holds ``writer``'s rows: one cache handed to two
        attention layers of the same shape took both layers' rows as one sequence's tokens (each layer
        then attended to the other's keys), without a word.

        A layer is known by its instance: a random number it is given at its first cached forward (an
        attribute, :data:`WRITER_TOKEN`), which its copies made after that (copy.deepcopy, pickle,
        torch.save of the layer with its cache) keep, as does a cache copied alone (a branch of a
        generation). An empty cache (new, or after :meth:`reset`) takes any layer; a layer rebuilt with
        the same weights (a saved prefix loaded for a new model) takes the rows over after
        :meth:`release_writer`. Not checked while torch.compile traces: a compiled decode step is built
        for one layer and its cache, and the token's first assignment would be a side effect in the graph."""
        if torch.compiler.is_compiling():
            return
        # setdefault: one atomic step, so two threads serving their first requests through one layer
        # cannot each give it a token and leave one request's cache holding a token since replaced
        token = vars(writer).setdefault(WRITER_TOKEN, secrets.randbits(63))
        held = self.__dict__.get("writer")  # a cache pickled before this check has none
        if self.max_len == 0 or held is None:
            self.writer = token
        elif held != token:
            raise ValueError(f"cache: it holds another attention layer's rows ({self.max_len} tokens); each layer "
                             f"needs a cache of its own (one LatentCache.from_config(...) per layer, or a model's "
                             f"own caches); cache.reset() empties it for another layer, cache.release_writer() "
                             f"hands its rows to the next layer that writes (the same weights, rebuilt)")

    def release_writer(self) -> None:
        """Forget which layer wrote the rows: the next layer that writes takes them over
        (:meth:`check_writer`), as when a prefix cache saved with one model is continued by the same
        weights loaded into another."""
        self.writer = None

    def check_rows(self, name: str, t, shape: tuple, labels: tuple = ("B", "T"),
                   stored: Optional[torch.dtype] = None) -> None:
        """A ValueError naming ``name`` unless ``t`` is a floating-point tensor of ``shape`` on this cache's
        device: rows on another device failed in torch's indexing ("Tensor on device cpu is not on the
        expected device meta!"), a shape that was wrong in its last dimension only failed in the buffer's
        copy ("The expanded size of the tensor (16) must match ..."), and complex rows were stored with
        their imaginary part dropped, a warning at most (integer rows would be rounded as silently). ``stored``:
        the dtype the rows are stored in (:func:`check_storable`)."""
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
            dims = ", ".join(f"{label}={d}" for label, d in zip(labels, shape))  # built only to refuse: every
            dims += "".join(f", {d}" for d in shape[len(labels):])  # decode step passes through here
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else f"{t!r:.80}"
            raise ValueError(f"{name}: expected a tensor [{dims}] for this cache, got {got}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected floating-point rows (the cache stores them as {name}.to(dtype)), "
                             f"got {t.dtype}")
        c, d = self.device, t.device  # as check_cache_device: a device without an index matches every index
        if c.type != d.type or (c.index is not None and d.index is not None and c.index != d.index):
            raise ValueError(f"{name}: the cache's buffers are on {c} and {name} is on {d}; pass {name}.to({str(c)!r}) "
                             f"or build the cache with device={str(d)!r}")
        if stored is not None:
            check_storable(name, t, stored)

    def stored_dtype(self, name: str) -> Optional[torch.dtype]:
        """The dtype field ``name`` stores its rows in; None for a buffer of another design (no storage tensor)."""
        storage = self.fields[name].storage() if name in self.fields else None
        return storage.dtype if storage is not None else None

    def check_slot(self, slot) -> None:
        """A ValueError naming ``slot`` unless it is what :meth:`plan` gives this cache now, judged by its Python
        ints alone (no device read per write): a slot of another cache (another batch, or past this capacity)
        failed in the buffer's copy ("The expanded size of the tensor (1) must match the existing size (2)"),
        and a slot written already (two plans, then two appends) wrote its rows over the first's, the lengths
        counting one of them, without a word."""
        if not isinstance(slot, WriteSlot):
            raise ValueError(f"slot: expected the WriteSlot cache.plan(...) returns, got {type(slot).__name__}")
        B, T = slot.slots.shape
        fresh = slot.max_len == self.max_len + T if slot.valid is None else slot.max_len >= self.max_len
        if B != self.batch_size or slot.max_len > self.capacity or not fresh:
            raise ValueError(f"slot: planned for {B} sequence(s) reaching {slot.max_len} tokens, but this cache holds "
                             f"batch_size={self.batch_size} sequence(s) of up to {self.max_len} tokens (capacity="
                             f"{self.capacity}); write each forward's rows with the slot this cache's plan() returned "
                             f"for them, once, before planning the next")
        # O(1) checks, no read of a tensor's values (a decode step on the GPU must not wait for one): a slot's tensors
        # edited in place (slot.slots[0, 0] = 4) were written as edited, a new token stored past its sequence's end
        # and a stale slot read in its place; a slot of another cache of the same shape set this one's lengths to
        # the other's. Both without a word.
        if torch.compiler.is_compiling():
            return
        if not slot.planned:
            return
        now = slot.watched(self)
        if not _unchanged(slot.planned[4:], now[4:]):
            raise ValueError("slot: planned by another cache, or by this one before its lengths last changed; write "
                             "the rows with the slot this cache's plan() returned for them")
        if not _unchanged(slot.planned[:4], now[:4]):
            raise ValueError("slot: its slots, valid, seqlens or next_positions are not what this cache's plan() gave "
                             "(replaced or edited in place since); write the rows with the slot plan() returned, "
                             "unedited")

    def write_rows(self, slot: WriteSlot, rows: dict[str, torch.Tensor]) -> None:
        """Store rows [B, T, width] of every field at the slot's slots and move the lengths on
        (the storage step under each cache's own ``append``/``update``)."""
        if set(rows) != set(self.fields):
            raise ValueError(f"rows: expected fields {sorted(self.fields)}, got {sorted(rows)}")
        self.check_slot(slot)
        B, T = slot.slots.shape
        if T == 0:  # plan(B, 0) is a slot (num_tokens may be 0): its empty rows failed in reshape(B, 0, -1)
            self.advance(slot)
            return
        if slot.valid is None and self.uniform:  # every sequence writes at the same slots
            for name, value in rows.items():
                self.fields[name].write_span(self.max_len, value.reshape(B, T, -1))
        elif slot.valid is None:
            batch_idx = torch.arange(B, device=self.device).repeat_interleave(T)
            slots = slot.slots.reshape(-1)
            for name, value in rows.items():
                self.fields[name].write(batch_idx, slots, value.reshape(B * T, -1))
        else:
            batch_idx, t_idx = slot.valid.nonzero(as_tuple=True)
            slots = slot.slots[batch_idx, t_idx]
            for name, value in rows.items():
                self.fields[name].write(batch_idx, slots, value[batch_idx, t_idx])
        self.advance(slot)

    def advance(self, slot: WriteSlot) -> None:
        """Move the lengths and positions on to ``slot``'s, its rows already stored (by
        :meth:`write_rows`, or in place by a compiled decode step)."""
        self._set_lengths(seqlens=slot.seqlens, next_positions=slot.next_positions, max_len=slot.max_len,
                          uniform=slot.uniform)

    def bookkeeping(self) -> tuple:
        """The lengths and positions, for :meth:`restore` (tensors are replaced, never written in place)."""
        return self.seqlens, self.next_positions, self.max_len, self.uniform

    def restore(self, bookkeeping: tuple) -> None:
        self._set_lengths(**dict(zip(("seqlens", "next_positions", "max_len", "uniform"), bookkeeping)))

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Undo the appends made inside the block if it raises.

        Appends only write slots past each sequence's length, so restoring the lengths is a
        complete undo: the rows written are unused slots again. A decode step appends its
        token and then attends; if attending fails, a retry must not see the token twice.
        A :meth:`keep` moves rows and is not undone: an eviction policy runs it as the last
        step of the block, after everything that may fail.
        """
        saved = self.bookkeeping()
        try:
            yield
        except BaseException:
            self.restore(saved)
            raise

    # -- dropping tokens ----------------------------------------------------------------------

    def keep(self, mask: torch.Tensor) -> torch.Tensor:
        """Keep the cached tokens where ``mask`` [B, max_len] (bool) is True and drop the rest.

        Sequence b's kept tokens move, in order, to its first k_b = mask[b].sum() slots; the
        rows of every field move together, copied as stored (a codec's quantized fields bit
        for bit). ``seqlens`` becomes k while ``next_positions`` keeps counting, so new tokens
        get the next RoPE positions and kept tokens keep theirs (their rotated keys stay valid).

        Paged layout: the compaction happens in place, within each sequence's own blocks (the
        block table is fixed); the slots freed at the end are the ones its next tokens fill.

        Returns:
            order [B, max_len]: order[b, i] is the slot whose row slot i now holds (i < k_b),
            for state kept per slot beside the cache (an eviction policy's scores).
        """
        order, lengths = self.keep_order(mask)
        self.apply_keep(order, lengths)
        return order

    def apply_keep(self, order: torch.Tensor, lengths: torch.Tensor) -> None:
        """:meth:`keep` given :meth:`keep_order`'s answer (order [B, max_len], lengths [B]),
        for a caller that asked it first. Everything is read and allocated before the first
        row is written."""
        # Called by the user (keep) on a cache filled under torch.inference_mode(), outside it: torch refused the
        # rows' write naming no cache (the eviction's call runs inside a forward, checked by plan already).
        self.check_writable("call cache.keep(mask)")
        B, S = self.batch_size, self.max_len
        slots = torch.arange(S, device=self.device)
        moved = (order != slots) & (slots < lengths[:, None])  # a kept prefix stays where it is
        batch_idx, dst = moved.nonzero(as_tuple=True)
        src = order[batch_idx, dst]
        rows = {name: buf.gather(batch_idx, src) for name, buf in self.fields.items()}
        positions = self.slot_positions().gather(1, order)
        kept = self._kept_positions
        # New, before the rows move, when there is none yet or it cannot be written here: made lazily under
        # torch.inference_mode() (a prefill there), it is written only inside it, and the next decode under
        # no_grad failed writing it, after the rows had moved. Else written in place: a new [B, capacity]
        # tensor at every eviction step cost O(capacity) each. (Only the first _kept_lens <= S are read.)
        if kept is None or written_only_in_inference_mode(kept):
            kept = torch.zeros(B, self.capacity, dtype=torch.long, device=self.device)
        max_len, uniform = int(lengths.max()), bool((lengths == lengths[0]).all())
        for name, value in rows.items():
            self.fields[name].write(batch_idx, dst, value)
        kept[:, :S] = positions
        self._kept_positions = kept
        self._kept_lens = lengths
        self._set_lengths(seqlens=lengths, max_len=max_len, uniform=uniform)

    def keep_order(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`keep` would do with ``mask``, changing nothing: (order [B, max_len] as
        keep returns it, the kept lengths [B]). For a caller that prepares everything that
        may fail before the rows move (an eviction policy's compacted state)."""
        B, S = self.batch_size, self.max_len
        self.check_readable("mask")
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (B, S):
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask: expected a bool tensor [batch_size={B}, max_len={S}], got {got}")
        check_has_values("mask", mask, self.device)
        mask = mask.to(self.device)
        if bool((mask & (torch.arange(S, device=self.device) >= self.seqlens[:, None])).any()):
            raise ValueError(f"mask: keeps a slot past its sequence's length (seqlens {self.seqlens.tolist()})")
        return torch.argsort((~mask).to(torch.int8), dim=1, stable=True), mask.sum(dim=1)  # kept slots first

    def slot_positions(self) -> torch.Tensor:
        """[B, max_len]: the RoPE position of the token in each slot (meaningless past a
        sequence's length). Equal to the slot until a :meth:`keep` drops tokens."""
        slots = torch.arange(self.max_len, device=self.device)
        appended = slots + (self.next_positions - self.seqlens)[:, None]
        if self._kept_positions is None:
            return appended
        return torch.where(slots < self._kept_lens[:, None], self._kept_positions[:, :self.max_len], appended)

    def restart_positions(self) -> None:
        """Number the cached tokens 0..seqlens-1 again and continue from there: for a caller
        that has just re-rotated every cached key to its slot (StreamingLLM's re-positioning)."""
        self._set_lengths(next_positions=self.seqlens.clone())
        self._kept_lens = torch.zeros_like(self._kept_lens)

    # -- the batch and the capacity (generation utilities: beam search, growth, rollback) -----

    def _contiguous_buffers(self, what: str) -> list[ContiguousBuffer]:
        buffers = list(self.fields.values())
        if not all(isinstance(b, ContiguousBuffer) for b in buffers):
            raise ValueError(f"layout: {what} needs the contiguous layout (a paged cache's block table belongs to "
                             f"its allocator), got {self.layout!r}")
        return buffers

    def select_sequences(self, indices: torch.Tensor) -> None:
        """Keep sequences ``indices`` [B'] in that order; an index may repeat (beam search's
        reorder, ``num_return_sequences``' repeat). Every field and per-sequence state moves
        together; the batch size becomes B'."""
        buffers = self._contiguous_buffers("select_sequences")
        self.check_readable("indices")
        # .long() truncated [0.7, 1.2] to [0, 1]: other sequences kept, silently; and a transformers
        # cache's reorder_cache(float beam_idx) moved the rows here, then failed on its own column mask
        indices = _integers("indices", indices, self.device, "an integer tensor of sequence indices")

        def refuse():
            shown = indices.tolist() if indices.numel() <= 16 else f"a tensor of shape {tuple(indices.shape)}"
            raise ValueError(f"indices: expected a non-empty 1-D tensor of sequence indices in [0, {self.batch_size}), "
                             f"got {shown}")

        if indices.dim() != 1 or len(indices) == 0:
            refuse()
        # Every buffer is copied for the new batch: checked as a whole first (torch's allocator's error
        # half way through left some buffers moved and others not), and before the indices' values are
        # read: min() of a broadcast index tensor (expand of one index to 10**9) allocated it whole first.
        per_sequence = sum(buf.nbytes // max(1, buf.data.shape[0]) for buf in buffers)
        check_allocation("indices", per_sequence * len(indices), f"a batch of {len(indices)} sequence(s) of "
                         f"capacity={self.capacity}", self.device)
        if int(indices.min()) < 0 or int(indices.max()) >= self.batch_size:
            refuse()
        for buf in buffers:
            buf.select(indices)
        seqlens = self.seqlens[indices]  # max_len and uniform move too: left stale, they described the old batch
        self._set_lengths(seqlens=seqlens, next_positions=self.next_positions[indices], max_len=int(seqlens.max()),
                          uniform=bool((seqlens == seqlens[0]).all()))
        self._kept_lens = self._kept_lens[indices]
        if self._kept_positions is not None:
            self._kept_positions = self._kept_positions[indices]
        if self.eviction is not None:
            self.eviction.select(indices)
        object.__setattr__(self, "batch_size", len(indices))  # FIXED to callers: the buffers moved with it

    def grow(self, capacity: int) -> None:
        """Raise the capacity to ``capacity`` slots per sequence, keeping every cached row. As
        ``std::vector::reserve``: a capacity at or below the current one leaves the cache as it is
        (it never shrinks, so no cached row can be lost)."""
        buffers = self._contiguous_buffers("grow")
        capacity = as_int(capacity)
        # As the constructor checks it: grow(nan) or grow(2.5) did nothing without a word, and
        # grow(2**62) reached torch's allocator (after resizing some buffers and not others).
        if not is_int(capacity) or capacity < 1:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        if capacity > self.capacity:
            per_slot = sum(buf.nbytes // max(1, buf.data.shape[1]) for buf in buffers)
            check_allocation("capacity", per_slot * capacity, f"{self.batch_size} sequence(s) of capacity={capacity} "
                             "tokens", self.device)
            for buf in buffers:
                buf.resize(capacity, self.max_len)
            if self._kept_positions is not None:
                kept = torch.zeros(self.batch_size, capacity, dtype=torch.long, device=self.device)
                kept[:, :self.capacity] = self._kept_positions
                self._kept_positions = kept
            object.__setattr__(self, "capacity", capacity)  # FIXED to callers: the buffers grew with it

    def drop_last(self, counts: torch.Tensor) -> None:
        """Forget the last ``counts[b]`` tokens of each sequence b (a rollback: speculative
        decoding's rejected tokens). Refused once an eviction policy has moved tokens."""
        self.check_readable("counts")
        # .long() truncated 0.5 to 0: a rollback that dropped nothing, without a word
        counts = _integers("counts", counts, self.device, f"integer token counts [{self.batch_size}]")
        if counts.shape != (self.batch_size,) or bool((counts < 0).any()) or bool((counts > self.seqlens).any()):
            raise ValueError(f"counts: expected [{self.batch_size}] non-negative counts no larger than the cached "
                             f"lengths {self.seqlens.tolist()}, got {counts.tolist()}")
        if self.eviction is not None:
            raise ValueError("counts: a cache with an eviction policy cannot roll tokens back (the dropped tokens "
                             "may be the ones it evicted instead)")
        seqlens = self.seqlens - counts
        self._set_lengths(seqlens=seqlens, next_positions=self.next_positions - counts, max_len=int(seqlens.max()),
                          uniform=bool((seqlens == seqlens[0]).all()))

    # -- reading -----------------------------------------------------------------------------

    def read(self, name: str) -> torch.Tensor:
        """Field ``name`` for the first S = max(seqlens) positions, [B, S, width].

        Slots past a shorter sequence's own length are returned as zeros: they may hold stale
        or never-written data (NaN, inf), and a masked softmax weight of 0 times NaN is still
        NaN in ``p @ v``. With equal lengths every slot is valid and nothing is copied.
        """
        if name not in self.fields:  # a bare KeyError('nope') said neither what was asked for nor what there is
            raise ValueError(f"name: expected one of this cache's fields {tuple(self.fields)}, got {name!r:.80}")
        data = self.fields[name].read(self.max_len)
        if not self.uniform:
            valid = torch.arange(self.max_len, device=self.device) < self.seqlens[:, None]
            data = data.masked_fill(~valid[..., None], 0)
        return data

    def reset(self) -> None:
        """Forget every sequence (the storage is reused, not cleared), and the autograd history its
        rows carry: a training step's rows made the buffers part of that step's graph, so the next
        step's writes into them chained onto it, and its backward failed with "Trying to backward
        through the graph a second time" once the first step's had run."""
        for buf in self.fields.values():
            buf.forget_history()
        self._set_lengths(seqlens=torch.zeros_like(self.seqlens), next_positions=torch.zeros_like(self.next_positions),
                          max_len=0, uniform=True)
        self._kept_lens = torch.zeros_like(self._kept_lens)
        if self.eviction is not None:
            self.eviction.reset()

    # -- size --------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token occupies (one layer), summed over fields."""
        return sum(buf.width * buf.element_size for buf in self.fields.values())

    @property
    def nbytes(self) -> int:
        """Bytes allocated by the storage of every field."""
        return sum(buf.nbytes for buf in self.fields.values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}[{b.width}]" for n, b in self.fields.items())
        return (f"{type(self).__name__}(batch_size={self.batch_size}, capacity={self.capacity}, "
                f"fields=({fields}), bytes_per_token={self.bytes_per_token}, layout={self.layout!r})")



# SequenceCache made directly (not through a subclass, whose constructors __init_subclass__ marks) is marked too.
SequenceCache.__init__ = _constructed(SequenceCache.__init__)
