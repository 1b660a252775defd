"""Scores of a trained model on held-out text: loss, perplexity and next-character accuracy
over every position of a split, and last-word-of-line accuracy (a character-level stand-in
for LAMBADA's last-word prediction).

``split_scores`` reads the split as consecutive windows of the model's context; every
position after the first is predicted exactly once (the last window is moved back to end at
the split's end and scores only the positions the others did not), so the loss is the mean
over the whole split, not over a sample of windows.

``heldout_scores``: the held-out fields of an experiment's results row (validation split, and
the test split where the corpus has one), from ``split_scores``.

``last_word_accuracy``: for each line of speech in the text (a line with a lower-case
letter: speaker names, titles and headings are upper case; not a stage direction in
brackets), the last word of at least ``min_letters`` letters, read with the context before
it. It counts as right when the model's most likely next character is each of the word's
letters in turn and then a character that ends a word (not a letter or apostrophe): exactly
what greedy decoding from the context would have to write.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

_WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
_WORD_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz'"
DEBUG_EVAL_TOKENS = 4096  # the debug preset (an experiment's --quick) scores this prefix of each split


def _windows(n_targets: int, block_size: int) -> list[tuple[int, int]]:
    """(start, first scored position) of the windows that predict each of the ``n_targets``
    positions once."""
    if n_targets < block_size:
        raise ValueError(f"data: {n_targets + 1} tokens are too few for block_size={block_size}")
    wins = [(s, 0) for s in range(0, n_targets - block_size + 1, block_size)]
    covered = wins[-1][0] + block_size
    if covered < n_targets:
        wins.append((n_targets - block_size, block_size - (n_targets - covered)))
    return wins


@torch.no_grad()
def split_scores(model, data: torch.Tensor, block_size: int, batch_size: int = 32) -> dict:
    """{"loss" (mean nats per predicted token), "perplexity", "accuracy" (argmax = next
    token), "tokens"} over every position of ``data`` [N] but the first."""
    model.eval()
    wins = _windows(len(data) - 1, block_size)
    nll, correct, count = 0.0, 0, 0
    offsets = torch.arange(block_size)
    for i in range(0, len(wins), batch_size):
        chunk = wins[i:i + batch_size]
        x = torch.stack([data[s:s + block_size] for s, _ in chunk])
        y = torch.stack([data[s + 1:s + 1 + block_size] for s, _ in chunk])
        scored = offsets[None, :] >= torch.tensor([k for _, k in chunk])[:, None]  # [b, T]
        logits, _ = model(x)
        losses = F.cross_entropy(logits.transpose(1, 2).float(), y, reduction="none")
        nll += float(losses[scored].double().sum())
        correct += int((logits.argmax(-1) == y)[scored].sum())
        count += int(scored.sum())
    loss = nll / count
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": correct / count, "tokens": count}


def heldout_scores(model, corpus, preset: str) -> dict:
    """The held-out fields of a results row: ``val_loss_all``, ``val_tokens``, ``val_accuracy``
    (:func:`split_scores` over ``corpus.val`` [N]) and, where the corpus has test text
    (``corpus.test`` not None), ``test_loss``, ``test_tokens``, ``test_accuracy`` and
    ``heldout_loss_pooled``, the token-weighted loss over both splits. Windows of the model's
    context; ``preset`` "debug" scores the first ``DEBUG_EVAL_TOKENS`` of each split."""
    block = model.config.block_size
    val, test = corpus.val, corpus.test
    if preset == "debug":
        val = val[:DEBUG_EVAL_TOKENS]
        test = test[:DEBUG_EVAL_TOKENS] if test is not None else None
    v = split_scores(model, val, block)
    out = {"val_loss_all": v["loss"], "val_tokens": v["tokens"], "val_accuracy": v["accuracy"]}
    if test is not None:
        t = split_scores(model, test, block)
        pooled = (v["loss"] * v["tokens"] + t["loss"] * t["tokens"]) / (v["tokens"] + t["tokens"])
        out.update(test_loss=t["loss"], test_tokens=t["tokens"], test_accuracy=t["accuracy"],
                   heldout_loss_pooled=pooled)
    return out


def last_words(text: str, min_letters: int = 3) -> list[tuple[int, int]]:
    """[(start, end)] character offsets of the last word of every line of speech (see the
    module docstring), in text order."""
    items, pos = [], 0
    for line in text.split("\n"):
        stripped = line.strip()
        if any(c.islower() for c in line) and not stripped.startswith("[") and "]" not in stripped:
            words = list(_WORD.finditer(line))
            if words:
                w = words[-1]
                tail = line[w.end():]
                if not any(c.isalpha() for c in tail) and sum(c.isalpha() for c in w.group()) >= min_letters:
                    items.append((pos + w.start(), pos + w.end()))
        pos += len(line) + 1
    return items


def evenly(items: list, limit: int) -> list:
    """At most ``limit`` items spread evenly over the list (no random draw: every run is
    scored on the same ones)."""
    if len(items) <= limit:
        return list(items)
    return [items[int(i * len(items) / limit)] for i in range(limit)]


@torch.no_grad()
def last_word_accuracy(model, ids: torch.Tensor, text: str, tokenizer, block_size: int, limit: int = 2048,
                       min_letters: int = 3, batch_size: int = 32) -> dict:
    """{"accuracy", "words"}: last-word-of-line accuracy over at most ``limit`` lines of
    ``text`` (``ids`` [N] its tokens, one per character) whose word and the character after
    it fit in one context with the text before it."""
    if tokenizer.kind != "char":
        raise ValueError(f"tokenizer: last-word accuracy reads one token per character, got {tokenizer.kind!r}")
    if len(ids) != len(text):
        raise ValueError(f"ids: expected one token per character of text ({len(text)}), got {len(ids)}")
    items = [(a, b) for a, b in last_words(text, min_letters)
             if b >= block_size and b - a <= block_size - 1 and b < len(text)]
    items = evenly(items, limit)
    if not items:
        raise ValueError("text: no line's last word fits in one context")
    word_ids = torch.tensor(sorted({tokenizer.stoi[c] for c in _WORD_CHARS if c in tokenizer.stoi}))
    model.eval()
    right = 0
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        # The window's inputs end just before the character after the word, so its last
        # target is that character and the word's letters are the targets before it.
        x = torch.stack([ids[b - block_size:b] for _, b in chunk])
        y = torch.stack([ids[b - block_size + 1:b + 1] for _, b in chunk])
        guess = model(x)[0].argmax(-1)  # [b, T]
        for row, (a, b) in enumerate(chunk):
            first = block_size - 1 - (b - a)  # position of the word's first letter as a target
            letters_right = bool((guess[row, first:-1] == y[row, first:-1]).all())
            ends_word = not bool((word_ids == guess[row, -1]).any())
            right += letters_right and ends_word
    return {"accuracy": right / len(items), "words": len(items)}
