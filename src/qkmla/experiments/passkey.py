"""A long-range check a compressed cache can fail: passkey records woven into Shakespeare.

The training text is tiny Shakespeare cut into passages of ``MIN_FILLER`` to ``MAX_FILLER``
characters, each wrapped as one record::

    #418207:<passage of Shakespeare>#418207\n

The key (``KEY_DIGITS`` random digits) is unpredictable where it opens a record and fully
predictable where it closes it, but only by attending back over the whole passage, 40 to
500 characters. The short passages teach copying (an induction head) quickly; the long ones
are where a compressed cache is tested (``key_targets(..., min_distance=)``). A model trained on this text learns to copy the key; a cache that
has dropped the key's tokens (eviction) or blurred them (quantization) cannot. The rest of
the text is ordinary Shakespeare, so the same model serves the validation-loss check.

The records keep the corpus's order, so nanoGPT's split (first 90% train, last 10%
validation) still puts unseen passages and keys in validation.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from ..utils.files import write_text

import torch

from ..train.data import Tokenizer, load_text

KEY_DIGITS = 6
MIN_FILLER, MAX_FILLER = 40, 500
SEED = 0
OPEN, CLOSE = "#", "#"


def random_key(rng: random.Random, digits: int = KEY_DIGITS) -> str:
    return "".join(rng.choice("0123456789") for _ in range(digits))


def record(key: str, filler: str) -> str:
    """One record: ``#KEY:filler#KEY`` and a newline."""
    return f"{OPEN}{key}:{filler}{CLOSE}{key}\n"


def passkey_text(source: str = "tiny_shakespeare", seed: int = SEED) -> str:
    """The whole record text (deterministic for a seed)."""
    text = load_text(source).replace(OPEN, " ")  # '#' only ever marks a key
    rng = random.Random(seed)
    records, i = [], 0
    while i < len(text):
        n = rng.randint(MIN_FILLER, MAX_FILLER)
        records.append(record(random_key(rng), text[i:i + n]))
        i += n
    return "".join(records)


def write_corpus(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` unless it already holds exactly that, and return the path."""
    if not path.is_file() or path.read_bytes() != text.encode("utf-8"):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, text)
    return path


def write_passkey_corpus(path: Path, source: str = "tiny_shakespeare") -> Path:
    """Write the record text to ``path`` (once; the same bytes every time) and return it."""
    return write_corpus(path, passkey_text(source))


def _opens_closes(ids: torch.Tensor, tok: Tokenizer, digits: int) -> tuple[list[int], list[int]]:
    """Offsets of the '#' that open records and of those that close them. A '#' opens when
    its key is followed by ':' and closes when it is followed by a newline (a passage may
    end in a newline, so a line's first '#' can close a record too)."""
    colon = tok.encode(":")[0]
    opens, closes = [], []
    for i in (ids == tok.encode(OPEN)[0]).nonzero().flatten().tolist():
        after = i + 1 + digits
        (opens if after < len(ids) and int(ids[after]) == colon else closes).append(i)
    return opens, closes


def record_starts(ids: torch.Tensor, tok: Tokenizer, digits: int = KEY_DIGITS) -> list[int]:
    """Offsets in ``ids`` [N] where a record (keys of ``digits`` digits) opens."""
    return _opens_closes(ids, tok, digits)[0]


def key_targets(ids: torch.Tensor, tok: Tokenizer, min_distance: int = 0, digits: int = KEY_DIGITS,
                max_distance: float = math.inf) -> torch.Tensor:
    """[N] bool: token i is a digit of a closing key (predictable only from its record's start).

    ``min_distance`` / ``max_distance``: only keys whose closing '#' lies at least / at most
    that many tokens after their opening '#' (a key whose opening lies before ``ids`` starts
    is never marked); ``digits``: the key length of the records.
    """
    opens, closes = _opens_closes(ids, tok, digits)
    out = torch.zeros(len(ids), dtype=torch.bool)
    j = -1
    for c in closes:
        while j + 1 < len(opens) and opens[j + 1] < c:
            j += 1
        if j >= 0 and min_distance <= c - opens[j] <= max_distance:
            out[c + 1:c + 1 + digits] = True
    return out
