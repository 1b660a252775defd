"""Text corpora, tokenizers and batches.

The embedded default is tiny Shakespeare (public domain, Project Gutenberg) with a
character vocabulary and nanoGPT's split: the first 90% trains, the last 10% validates, so
losses compare with nanoGPT's published figures. ``shakespeare`` (40 plays and poems,
4.8M characters) is also shipped. Any text file works, with a char or a byte vocabulary.

Splits (``split``): ``"tail"`` (the default) is the 90/10 split above. ``"plays"`` splits
the full ``shakespeare`` corpus by work: whole plays are held out for validation
(``VALIDATION_PLAYS``) and for testing (``TEST_PLAYS``), one comedy and one tragedy each,
about 4.8% and 4.7% of the text, and every other work (plays and poems) trains. In that
corpus each work opens with its title line followed by "by William Shakespeare".
"""

from __future__ import annotations

import lzma
import re
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Optional

import torch

from ..utils.files import input_file_problem

EMBEDDED = {"tiny_shakespeare": "tiny_shakespeare.txt.xz", "shakespeare": "shakespeare.txt.xz"}
TOKENIZERS = ("char", "byte")
SPLITS = ("tail", "plays")
VALIDATION_PLAYS = ("TWELFTH NIGHT; OR, WHAT YOU WILL", "JULIUS CAESAR")
TEST_PLAYS = ("MUCH ADO ABOUT NOTHING", "MACBETH")
_WORK_TITLE = re.compile(r"^([^\n]+)\n\n?by William Shakespeare\n", re.M)


def load_bytes(source: str = "tiny_shakespeare") -> bytes:
    """The bytes of an embedded corpus by name, or of a file path."""
    if source in EMBEDDED:
        return lzma.decompress(resources.files("qkmla").joinpath("data", EMBEDDED[source]).read_bytes())
    if source == "":  # Path("") is ".", so an empty name was refused as "it is a directory"
        raise ValueError(f"data: expected one of {sorted(EMBEDDED)} or a path to a text file, got an empty string")
    path = Path(source)
    problem = input_file_problem(path)
    if problem is not None:
        raise ValueError(f"data: expected one of {sorted(EMBEDDED)} or a path to a text file, got {source!r}: it "
                         f"{problem}")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"data: cannot read {source} ({e.strerror})") from None
    if not data:
        raise ValueError(f"data: {source} is empty")
    return data


def load_text(source: str = "tiny_shakespeare") -> str:
    """An embedded corpus by name, or the text of a UTF-8 file path (any other file is refused:
    a char vocabulary of replacement characters would be a silent change of the data)."""
    data = load_bytes(source)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data: {source} is not UTF-8 text (byte {e.start} is {data[e.start:e.start + 1]!r}); "
                         f"--tokenizer byte trains on a file's bytes, whatever they are") from None


class Tokenizer:
    """Char-level (vocabulary = the characters of the corpus) or byte-level (256 ids)."""

    def __init__(self, kind: str = "char", chars: Optional[str] = None):
        if kind not in TOKENIZERS:
            raise ValueError(f"tokenizer: expected one of {TOKENIZERS}, got {kind!r}")
        if kind == "char" and not chars:
            raise ValueError("chars: a char tokenizer needs its vocabulary")
        self.kind, self.chars = kind, chars
        self.stoi = {c: i for i, c in enumerate(chars)} if kind == "char" else None

    @classmethod
    def fit(cls, text: str, kind: str = "char") -> "Tokenizer":
        return cls(kind, "".join(sorted(set(text))) if kind == "char" else None)

    @property
    def vocab_size(self) -> int:
        return len(self.chars) if self.kind == "char" else 256

    def encode(self, text: str) -> list[int]:
        if self.kind == "byte":
            return list(text.encode("utf-8"))
        unknown = set(text) - set(self.stoi)
        if unknown:
            raise ValueError(f"text: characters outside the vocabulary: {sorted(unknown)[:10]}")
        return [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        if self.kind == "byte":
            return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
        return "".join(self.chars[int(i)] for i in ids)

    def state(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


def data_fingerprint(text) -> dict:
    """What identifies a corpus whatever path it was read from: its length in characters and
    the CRC-32 of its bytes (``text`` a str, or the bytes a byte tokenizer reads; for UTF-8
    text both give the same fingerprint)."""
    data = text if isinstance(text, bytes) else text.encode("utf-8", errors="replace")
    chars = len(data.decode("utf-8", errors="replace")) if isinstance(text, bytes) else len(text)
    return {"chars": chars, "crc32": zlib.crc32(data)}


def works(text: str) -> list[tuple[str, int, int]]:
    """(title, start, end) of every work in the ``shakespeare`` corpus, in order: a work runs
    from its title line to the next work's title line (the end of the text for the last)."""
    found = list(_WORK_TITLE.finditer(text))
    ends = [m.start() for m in found[1:]] + [len(text)]
    return [(m.group(1).strip(), m.start(), end) for m, end in zip(found, ends)]


def split_by_play(text: str) -> dict[str, str]:
    """{"train", "val", "test"}: the text of the works in each split, concatenated in corpus
    order. Raises ValueError if a held-out play is missing or the text before the first
    title is not empty (not the embedded ``shakespeare`` corpus)."""
    parts = works(text)
    titles = [t for t, _, _ in parts]
    missing = [t for t in VALIDATION_PLAYS + TEST_PLAYS if t not in titles]
    if missing or not parts or parts[0][1] != 0:
        raise ValueError(f"split: 'plays' needs the embedded 'shakespeare' corpus (works opening with a title and "
                         f"'by William Shakespeare'); missing held-out plays: {missing or 'none'}")
    out = {"train": [], "val": [], "test": []}
    for title, start, end in parts:
        name = "val" if title in VALIDATION_PLAYS else "test" if title in TEST_PLAYS else "train"
        out[name].append(text[start:end])
    return {k: "".join(v) for k, v in out.items()}


@dataclass
class Corpus:
    """Token ids split into train and validation (and, split by play, test); ``fingerprint``
    identifies the text (resuming a run checks it). The char vocabulary is fitted on the
    whole text, so every split encodes with it."""

    tokenizer: Tokenizer
    train: torch.Tensor
    val: torch.Tensor
    fingerprint: Optional[dict] = None
    test: Optional[torch.Tensor] = None

    @classmethod
    def load(cls, source: str = "tiny_shakespeare", tokenizer: str = "char", train_fraction: float = 0.9,
             split: str = "tail") -> "Corpus":
        """``split``: "tail" (the first ``train_fraction`` trains, the rest validates) or
        "plays" (see the module docstring; the ``shakespeare`` corpus only)."""
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
        if tokenizer == "byte" and split == "tail":  # the file's bytes as they are, UTF-8 or not
            data = load_bytes(source)
            ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
            n = int(train_fraction * len(ids))
            return cls(Tokenizer("byte"), ids[:n], ids[n:], data_fingerprint(data))
        text = load_text(source)
        tok = Tokenizer.fit(text, tokenizer)
        if split == "plays":
            parts = split_by_play(text)
            ids = {k: torch.tensor(tok.encode(v), dtype=torch.long) for k, v in parts.items()}
            return cls(tok, ids["train"], ids["val"], data_fingerprint(text), ids["test"])
        ids = torch.tensor(tok.encode(text), dtype=torch.long)
        n = int(train_fraction * len(ids))
        return cls(tok, ids[:n], ids[n:], data_fingerprint(text))

    def check_block(self, block_size: int, argument: str = "data") -> None:
        """Both splits must hold one block plus its target token (checked before training).
        ``argument`` leads the refusal: ``block_size`` when the user chose it (a block far past
        the file is that choice's mistake), ``data`` when the preset's block is too long for it."""
        for name, ids in (("training", self.train), ("validation", self.val)):
            if len(ids) < block_size + 2:
                raise ValueError(f"{argument}: the {name} split has {len(ids)} tokens, too few for one block of "
                                 f"block_size={block_size} (needs {block_size + 2}); use more text or a smaller "
                                 "--block-size")


def fixed_windows(data: torch.Tensor, count: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` windows spread evenly over ``data``, with no random draw: every run and every
    seed sees the same ones, so validation losses compare across runs. x [count, T], y [count, T]."""
    return windows_at(data, fixed_starts(data, count, block_size), block_size)


def fixed_starts(data: torch.Tensor, count: int, block_size: int) -> list[int]:
    """Where :func:`fixed_windows`' windows start (so a caller can build them a batch at a time)."""
    if count < 1:
        raise ValueError(f"count: expected a positive number of windows, got {count}")
    if len(data) <= block_size + 1:
        raise ValueError(f"data: {len(data)} tokens are too few for block_size={block_size}")
    return torch.linspace(0, len(data) - block_size - 1, count).long().tolist()


def windows_at(data: torch.Tensor, starts: list, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [len(starts), T] from each start, y the same shifted by one token."""
    x = torch.stack([data[i:i + block_size] for i in starts])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in starts])
    return x, y


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator):
    """Random windows (nanoGPT style): x [B, T], y [B, T] shifted by one token."""
    if len(data) <= block_size + 1:
        raise ValueError(f"data: {len(data)} tokens are too few for block_size={block_size}")
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)
    return windows_at(data, ix.tolist(), block_size)
