"""A byte tokenizer and a local text dataset for torchtitan's Trainer: no download, no tokenizer files.

torchtitan's text datasets come from the Hugging Face hub (``c4``) or its test assets, with a
tokenizer read from ``hf_assets_path``. qkmla's configs (``config_registry.py``) train on the
Shakespeare that ships inside qkmla (or any local text file) with bytes as tokens:

* :class:`ByteTokenizer`: ids are a text's UTF-8 bytes (vocabulary 256, no special tokens);
* :class:`LocalTextDataLoader`: the corpus as documents (the embedded ``shakespeare``: one per work,
  split by play as ``qkmla train --split plays`` splits it; a file: one document), packed into
  windows of ``seq_len`` tokens in torchtitan's convention: ``{"input", "positions"}`` and labels,
  positions restarting at 0 at each document's start and at each window's start (so they stay
  under ``seq_len``, within the RoPE table), and a document's last token never asked to predict
  the next document's first (its label is torchtitan's ignore index). Window ``w`` of an epoch goes to
  data-parallel rank ``w % dp_world_size``; later epochs visit the windows in a seeded shuffled
  order; the position in the stream is the loader's checkpointed state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from .versions import check_torchtitan

check_torchtitan()

import torch  # noqa: E402
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.loss import IGNORE_INDEX  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402

from ...train.data import load_bytes, load_text, split_by_play, works  # noqa: E402
from ...utils.checked import as_int, is_int  # noqa: E402

BYTES = 256
SPLITS = ("train", "val", "test", "all")


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as token ids (0..255); torchtitan's ``add_bos``/``add_eos`` are accepted and add
    nothing: a byte vocabulary has no room for special tokens, documents are told apart by their
    positions (:class:`LocalTextDataLoader`)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, *, tokenizer_path: str | None = None, **kwargs):
        super().__init__()  # eos_id None: no special tokens

    def encode(self, text: str, *args, add_bos: bool = False, add_eos: bool = False, **kwargs) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, *args, **kwargs) -> str:
        ids = [as_int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]  # a NumPy int is an int
        # int(i) truncated 65.7 to 65 ("A") without a word, and failed on NaN ("cannot convert float NaN to integer")
        bad = [i for i in ids if not is_int(i) or not 0 <= i < BYTES]
        if bad:
            raise ValueError(f"ids: a byte tokenizer decodes integer ids in [0, {BYTES}), got {bad[:5]}")
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return BYTES


def documents(source: str, split: str) -> list[bytes]:
    """The documents of ``split`` ("train" / "val" / "test" / "all") of ``source``: the embedded
    ``shakespeare`` by work, split by play; anything else (``tiny_shakespeare``, a file) is one
    document and has only "all"."""
    if split not in SPLITS:
        raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
    if source == "shakespeare":
        text = load_text(source)
        if split == "all":
            return [text[s:e].encode("utf-8") for _, s, e in works(text)]
        held = split_by_play(text)[split]
        return [held[s:e].encode("utf-8") for _, s, e in works(held)]
    if split != "all":
        raise ValueError(f"split: {source!r} is one document and has no {split!r} split; use split 'all' "
                         f"(the embedded 'shakespeare' splits by play)")
    return [load_bytes(source)]


def pack(docs: list[bytes], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``docs`` as windows: inputs, positions, labels, each [windows, seq_len] int64 (the last partial
    window is dropped). Labels are the next token within a document, the ignore index at its end."""
    # As every size qkmla takes: seq_len=nan or 2.5 failed in the slicing below ("slice indices must be
    # integers"), "4" in the comparison, and True was a window of 1 byte
    seq_len = as_int(seq_len)  # np.int64(4) is the length it holds, as the slicing below takes it
    if not is_int(seq_len) or seq_len < 1:
        raise ValueError(f"seq_len: expected a positive int (the window length in bytes), got {seq_len!r}")
    if not any(docs):  # torch.cat's "expected a non-empty list of Tensors" named nothing of the caller's
        raise ValueError(f"docs: expected at least one non-empty document, got {len(docs)} document(s) and no bytes")
    tokens = torch.cat([torch.frombuffer(bytearray(d), dtype=torch.uint8).long() for d in docs if d])
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    offset = 0
    for d in docs:
        if d:
            starts[offset] = True
            offset += len(d)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:-1] = torch.where(starts[1:], IGNORE_INDEX, tokens[1:])
    n = len(tokens) // seq_len
    if n == 0:
        raise ValueError(f"seq_len: {seq_len} is longer than the data ({len(tokens)} tokens)")
    tokens, labels, starts = (t[:n * seq_len].view(n, seq_len) for t in (tokens, labels, starts))
    starts[:, 0] = True  # each window restarts its positions
    index = torch.arange(seq_len).expand(n, -1)
    last_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return tokens, index - last_start, labels


class LocalTextDataset(IterableDataset, Stateful):
    """One data-parallel rank's windows of a local corpus (module docstring), endless if ``infinite``."""

    def __init__(self, source: str, split: str, seq_len: int, dp_rank: int = 0, dp_world_size: int = 1,
                 infinite: bool = True, seed: int = 0):
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank: expected 0 <= dp_rank < dp_world_size ({dp_world_size}), got {dp_rank}")
        self.inputs, self.positions, self.labels = pack(documents(source, split), seq_len)
        if len(self.inputs) < dp_world_size:
            raise ValueError(f"seq_len: {len(self.inputs)} windows of {seq_len} tokens cannot feed {dp_world_size} "
                             f"data-parallel ranks")
        self.dp_rank, self.dp_world_size, self.infinite, self.seed = dp_rank, dp_world_size, infinite, seed
        self.epoch, self.index = 0, 0  # the next window: this rank's index-th of this epoch

    def _order(self) -> torch.Tensor:
        n = len(self.inputs) - len(self.inputs) % self.dp_world_size  # every rank the same count
        if self.epoch == 0:
            return torch.arange(n)
        return torch.randperm(len(self.inputs), generator=torch.Generator().manual_seed(self.seed + self.epoch))[:n]

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            mine = self._order()[self.dp_rank::self.dp_world_size]
            while self.index < len(mine):
                w = int(mine[self.index])
                self.index += 1
                yield {"input": self.inputs[w], "positions": self.positions[w]}, self.labels[w]
            if not self.infinite:
                return
            self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch, self.index = int(state_dict["epoch"]), int(state_dict["index"])


class LocalTextDataLoader(ParallelAwareDataloader):
    """torchtitan's data-parallel, checkpointable loader over :class:`LocalTextDataset`.

    ``dataset``: an embedded corpus (``shakespeare``, ``tiny_shakespeare``) or a text file's path;
    ``split``: "train" / "val" / "test" (``shakespeare``) or "all"."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        dataset: str = "shakespeare"
        """an embedded corpus or a local text file's path"""
        split: str = "train"
        """"train" / "val" / "test" (the embedded shakespeare, split by play) or "all" """
        infinite: bool = True
        """loop over the data (later epochs shuffled)"""
        seed: int = 0
        """the shuffle of epochs after the first"""

    def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: BaseTokenizer,
                 seq_len: int, local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
        if not isinstance(tokenizer, ByteTokenizer):
            raise ValueError(f"tokenizer: LocalTextDataLoader reads bytes; expected qkmla's ByteTokenizer.Config, "
                             f"got {type(tokenizer).__name__}")
        source = config.dataset_path or config.dataset
        dataset = LocalTextDataset(source, config.split, seq_len, dp_rank, dp_world_size, config.infinite,
                                   config.seed)
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, num_workers=config.num_workers,
                         persistent_workers=config.persistent_workers, pin_memory=config.pin_memory,
                         prefetch_factor=config.prefetch_factor, snapshot_every_n_steps=snapshot_every_n_steps,
                         batch_size=local_batch_size)
