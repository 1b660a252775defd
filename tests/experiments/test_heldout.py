"""Held-out scores: every position once, a results row's fields from both splits, and last-word
accuracy as greedy decoding would score it."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from qkmla.experiments.heldout import (
    DEBUG_EVAL_TOKENS,
    evenly,
    heldout_scores,
    last_word_accuracy,
    last_words,
    split_scores,
)
from qkmla.model.gpt import GPT, GPT_PRESETS
from qkmla.train.data import Tokenizer


class Oracle(torch.nn.Module):
    """Predicts the true next token of ``data`` wherever its input window sits in it, except
    that ``wrong`` tokens are never predicted (it says ``instead``)."""

    def __init__(self, data: torch.Tensor, vocab: int, wrong=(), instead: int = 0):
        super().__init__()
        self.data, self.vocab, self.wrong, self.instead = data, vocab, set(wrong), instead

    def forward(self, x):
        out = torch.zeros(*x.shape, self.vocab)
        n = x.shape[1]
        for b, row in enumerate(x):
            start = next(s for s in range(len(self.data) - n + 1) if torch.equal(self.data[s:s + n], row))
            for t in range(n):
                nxt = int(self.data[start + t + 1])
                out[b, t, self.instead if nxt in self.wrong else nxt] = 10.0
        return out, None


def test_split_scores_predict_every_position_once():
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(attn="mla", block_size=8)).eval()
    data = torch.randint(0, 65, (30,))  # 29 targets: 3 full windows of 8, then 5 more
    got = split_scores(model, data, 8, batch_size=2)
    assert got["tokens"] == 29
    total = 0.0
    for s in (0, 8, 16):
        logits, _ = model(data[s:s + 8][None])
        total += float(F.cross_entropy(logits[0].detach(), data[s + 1:s + 9], reduction="sum"))
    logits, _ = model(data[21:29][None])  # the last window ends at the end; its last 5 targets count
    total += float(F.cross_entropy(logits[0, 3:].detach(), data[25:30], reduction="sum"))
    assert got["loss"] == pytest.approx(total / 29, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))
    with pytest.raises(ValueError, match="too few"):
        split_scores(model, data[:5], 8)


def test_heldout_scores_are_each_splits_scores_and_their_token_weighted_pool():
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(attn="mla", block_size=8)).eval()
    val, test = torch.randint(0, 65, (30,)), torch.randint(0, 65, (50,))
    got = heldout_scores(model, SimpleNamespace(val=val, test=test), "cpu")
    v, t = split_scores(model, val, 8), split_scores(model, test, 8)
    assert (got["val_loss_all"], got["val_tokens"], got["val_accuracy"]) == (v["loss"], 29, v["accuracy"])
    assert (got["test_loss"], got["test_tokens"], got["test_accuracy"]) == (t["loss"], 49, t["accuracy"])
    assert got["heldout_loss_pooled"] == pytest.approx((29 * v["loss"] + 49 * t["loss"]) / 78, rel=1e-12)
    assert v["loss"] != t["loss"]  # else any weighting would pass
    assert set(heldout_scores(model, SimpleNamespace(val=val, test=None), "cpu")) == {
        "val_loss_all", "val_tokens", "val_accuracy"}
    long = SimpleNamespace(val=torch.randint(0, 65, (DEBUG_EVAL_TOKENS + 40,)), test=torch.randint(0, 65, (100,)))
    quick = heldout_scores(model, long, "debug")  # a prefix of each split; a shorter one whole
    assert (quick["val_tokens"], quick["test_tokens"]) == (DEBUG_EVAL_TOKENS - 1, 99)


def test_last_words_are_the_ends_of_spoken_lines():
    text = "HAMLET.\nTo be, or not to be: that is the question.\n[Exit.]\nO, I die, Horatio;\nAy me!\n"
    words = [text[a:b] for a, b in last_words(text)]
    assert words == ["question", "Horatio"]  # not the speaker, the stage direction, or a 2-letter word
    assert evenly(list(range(10)), 4) == [0, 2, 5, 7] and evenly([1, 2], 5) == [1, 2]


def test_last_word_accuracy_is_greedy_decoding_of_the_word():
    text = ("a line of speech that ends in question.\n" * 3) + "another line with a longer ending, Horatio;\n"
    tok = Tokenizer.fit(text)
    ids = torch.tensor(tok.encode(text))
    perfect = last_word_accuracy(Oracle(ids, tok.vocab_size), ids, text, tok, 16)
    assert perfect == {"accuracy": 1.0, "words": 4}
    # One wrong letter ("H", only in the last word) costs that word; a word boundary guessed as a
    # letter (".", after "question") costs the three others.
    assert last_word_accuracy(Oracle(ids, tok.vocab_size, [tok.stoi["H"]], tok.stoi["q"]), ids, text, tok,
                              16)["accuracy"] == 0.75
    assert last_word_accuracy(Oracle(ids, tok.vocab_size, [tok.stoi["."]], tok.stoi["q"]), ids, text, tok,
                              16)["accuracy"] == 0.25
    with pytest.raises(ValueError, match="tokenizer"):
        last_word_accuracy(Oracle(ids, 256), ids, text, Tokenizer("byte"), 16)
