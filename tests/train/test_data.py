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


def test_split_by_play_holds_out_whole_plays():
    from qkmla.train.data import TEST_PLAYS, VALIDATION_PLAYS, split_by_play, works

    text = load_text("shakespeare")
    parts = works(text)
    assert len(parts) == 40 and parts[0][1] == 0 and parts[-1][2] == len(text)
    assert all(a[2] == b[1] for a, b in zip(parts, parts[1:]))  # the works tile the text
    split = split_by_play(text)
    assert sum(len(v) for v in split.values()) == len(text)
    for name, titles in (("val", VALIDATION_PLAYS), ("test", TEST_PLAYS)):
        held = [text[s:e] for t, s, e in parts if t in titles]
        assert split[name] == "".join(held)
        for play in held:  # no line of a held-out play's opening speeches is in training
            assert play[2000:2400] not in split["train"]
    corpus = Corpus.load("shakespeare", split="plays")
    assert corpus.tokenizer.vocab_size == 84
    assert (len(corpus.train), len(corpus.val), len(corpus.test)) == tuple(len(split[k]) for k in
                                                                            ("train", "val", "test"))
    assert corpus.tokenizer.decode(corpus.test[:7]) == "MACBETH"  # in corpus order, before Much Ado
    assert Corpus.load("tiny_shakespeare").test is None


def test_split_by_play_refuses_other_text(tmp_path):
    from qkmla.train.config import TrainConfig

    with pytest.raises(ValueError, match="split: 'plays' needs the embedded 'shakespeare'"):
        Corpus.load("tiny_shakespeare", split="plays")
    with pytest.raises(ValueError, match="split: expected one of"):
        Corpus.load("tiny_shakespeare", split="middle")
    with pytest.raises(ValueError, match="split: 'plays' holds out whole plays"):
        TrainConfig(data="tiny_shakespeare", split="plays")


def test_a_byte_tokenizer_trains_on_the_files_bytes_and_a_char_one_refuses_non_utf8(tmp_path):
    """Issue 27, class 3: bytes that are not UTF-8 (Latin-1 text, binary) are the data, as they
    are, for --tokenizer byte; a char vocabulary would turn them into replacement characters,
    so it is refused naming the file and the byte."""
    raw = ("café " * 40).encode("latin-1") + bytes(range(256))
    f = tmp_path / "latin1.txt"
    f.write_bytes(raw)
    c = Corpus.load(str(f), tokenizer="byte")
    assert torch.equal(torch.cat([c.train, c.val]), torch.tensor(list(raw)))
    assert 0xE9 in c.train.tolist() and 0xFFFD not in c.train.tolist()
    with pytest.raises(ValueError, match=r"data: .*latin1.txt is not UTF-8 text \(byte 3 is b'\\xe9'\)"):
        Corpus.load(str(f), tokenizer="char")
    # UTF-8 text keeps the fingerprint it had (a resumed run's data check compares it).
    g = tmp_path / "utf8.txt"
    g.write_text("héllo wörld " * 50)
    from qkmla.train.data import data_fingerprint
    assert Corpus.load(str(g), tokenizer="byte").fingerprint == data_fingerprint(g.read_text())
