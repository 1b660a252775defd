import pytest
import torch

from qkmla.train.data import Corpus, Tokenizer, get_batch, load_text


def test_embedded_tiny_shakespeare_is_nanogpt_split():
    corpus = Corpus.load("tiny_shakespeare")
    assert corpus.tokenizer.vocab_size == 65
    assert len(corpus.train) + len(corpus.val) == 1_115_394
    assert len(corpus.train) == int(0.9 * 1_115_394)
    assert corpus.tokenizer.decode(corpus.train[:14]) == "First Citizen:"


def test_full_corpus_and_files(tmp_path):
    assert len(load_text("shakespeare")) == 4_784_896
    f = tmp_path / "t.txt"
    f.write_text("héllo wörld " * 50)
    c = Corpus.load(str(f), tokenizer="byte")
    assert c.tokenizer.vocab_size == 256
    assert c.tokenizer.decode(c.train[:6]) == "héllo"
    with pytest.raises(ValueError, match="data"):
        load_text(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="tokenizer"):
        Tokenizer("bpe")


def test_batches_are_shifted_and_reproducible():
    data = torch.arange(1000)
    x, y = get_batch(data, 4, 8, torch.Generator().manual_seed(0))
    assert torch.equal(y, x + 1)
    x2, _ = get_batch(data, 4, 8, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)
