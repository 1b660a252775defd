"""The passkey records of the compression experiment: layout, determinism, and which tokens are keys."""

import re

import torch

from qkmla.experiments.passkey import (KEY_DIGITS, MAX_FILLER, MIN_FILLER, key_targets, passkey_text,
                                       record_starts)
from qkmla.train.data import Tokenizer, load_text


def test_records_wrap_the_whole_corpus_in_order_with_a_repeated_key():
    text = passkey_text()
    assert text == passkey_text()  # the same bytes every time
    records = re.findall(rf"#(\d{{{KEY_DIGITS}}}):([^#]*)#(\d{{{KEY_DIGITS}}})\n", text)
    assert "".join(f"#{k}:{f}#{k2}\n" for k, f, k2 in records) == text  # nothing but records
    assert all(k == k2 for k, _, k2 in records)
    assert all(MIN_FILLER <= len(f) <= MAX_FILLER for _, f, _ in records[:-1])
    assert "".join(f for _, f, _ in records) == load_text().replace("#", " ")
    assert len({k for k, _, _ in records}) > 0.9 * len(records)  # keys are not one repeated string


def test_key_targets_mark_only_closing_key_digits():
    text = "#123456:to be#123456\n#654321:or not#654321\n"
    tok = Tokenizer.fit(text)
    ids = torch.tensor(tok.encode(text))
    marked = "".join(c for c, m in zip(text, key_targets(ids, tok).tolist()) if m)
    assert marked == "123456654321"
    assert [text[i] for i in record_starts(ids, tok)] == ["#", "#"] and record_starts(ids, tok)[0] == 0
    assert len(record_starts(ids, tok)) == 2


def test_a_closing_key_at_the_start_of_a_line_is_still_a_closing_key():
    text = "ab#111111\n#222222:line\n#222222\n#333333:x#333333\n"  # starts mid-record, as a split does
    tok = Tokenizer.fit(text)
    ids = torch.tensor(tok.encode(text))
    marked = "".join(c for c, m in zip(text, key_targets(ids, tok).tolist()) if m)
    assert marked == "222222333333"  # not the first record's key: its opening is not in the text
    assert [text[i + 1] for i in record_starts(ids, tok)] == ["2", "3"]


def test_every_record_of_the_validation_split_is_scored():
    text = passkey_text()
    tok = Tokenizer.fit(text)
    val = torch.tensor(tok.encode(text[int(0.9 * len(text)):]))
    closes = int(key_targets(val, tok).sum()) // KEY_DIGITS
    assert closes == len(record_starts(val, tok)) >= 400


def test_key_targets_can_keep_only_long_range_keys():
    text = "#111111:ab#111111\n#222222:" + "x" * 20 + "#222222\n"
    tok = Tokenizer.fit(text)
    ids = torch.tensor(tok.encode(text))
    marked = "".join(c for c, m in zip(text, key_targets(ids, tok, min_distance=15).tolist()) if m)
    assert marked == "222222"


def test_key_targets_can_keep_only_keys_within_a_distance():
    text = "#1:ab#1\n#2:" + "x" * 20 + "#2\n"
    tok = Tokenizer.fit(text)
    ids = torch.tensor(tok.encode(text))
    marked = "".join(c for c, m in zip(text, key_targets(ids, tok, digits=1, max_distance=10).tolist()) if m)
    assert marked == "1"  # the second record's closing '#' lies 23 tokens after its opening
    assert "".join(c for c, m in zip(text, key_targets(ids, tok, digits=1, max_distance=23).tolist()) if m) == "12"
