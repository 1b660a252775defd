"""The retrieval experiment's records, windows and scoring (the training grid runs in test_experiments)."""

import math
import re

import pytest
import torch

from qkmla.experiments.passkey import key_targets
from qkmla.experiments.retrieval import (MAX_FILLER, MIN_FILLER, TEXT_CHARS, key_scores, key_windows,
                                         retrieval_text)
from qkmla.train.data import Tokenizer


@pytest.fixture(scope="module")
def text():
    return retrieval_text()


def test_records_are_one_digit_keys_around_random_letters(text):
    assert text == retrieval_text() and text != retrieval_text(seed=1)
    records = re.findall(r"#(\d):([a-z]*)#(\d)\n", text)
    assert "".join(f"#{k}:{f}#{k2}\n" for k, f, k2 in records) == text  # nothing but records
    assert all(k == k2 for k, _, k2 in records)
    assert all(MIN_FILLER <= len(f) <= MAX_FILLER for _, f, _ in records)
    assert TEXT_CHARS <= len(text) < TEXT_CHARS + MAX_FILLER + 8
    counts = torch.bincount(torch.tensor([int(k) for k, _, _ in records]), minlength=10).float() / len(records)
    assert counts.min() > 0.08 and counts.max() < 0.12  # keys are uniform: chance is 1/10


def test_key_targets_mark_the_closing_digit_of_one_digit_keys():
    text = "#3:abc#3\n#7:de#7\n"
    tok = Tokenizer.fit(text)
    ids = torch.tensor(tok.encode(text))
    assert "".join(c for c, m in zip(text, key_targets(ids, tok, digits=1).tolist()) if m) == "37"


def test_windows_end_at_a_closing_hash_with_the_answer_in_view(text):
    tok = Tokenizer.fit(text)
    val = torch.tensor(tok.encode(text[-20_000:]))
    x, y = key_windows(val, tok, 32, 128)
    assert x.shape == (32, 128) and y.shape == (32,)
    for row, answer in zip(x.tolist(), y.tolist()):
        s = tok.decode(row)
        assert s.endswith("#") and s[-2] in "abcdefghijklmnopqrstuvwxyz"  # a closing '#'
        assert re.findall(r"#(\d):", s)[-1] == tok.decode([answer])  # its record opened inside the window
    with pytest.raises(ValueError, match="count"):
        key_windows(val, tok, 10_000, 128)


class _LastDigit(torch.nn.Module):
    """Predicts the most recent digit in its input (the right answer) or always `constant`."""

    def __init__(self, tok, constant=None):
        super().__init__()
        self.digits = torch.tensor(tok.encode("0123456789"))
        self.vocab, self.constant = tok.vocab_size, constant

    def forward(self, x):
        logits = torch.zeros(*x.shape, self.vocab)
        for b, row in enumerate(x):
            pos = torch.isin(row, self.digits).nonzero().flatten()
            guess = self.constant if self.constant is not None else row[pos[-1]]
            logits[b, -1, guess] = 20.0
        return logits, None


def test_scores_separate_a_retriever_from_a_guesser(text):
    tok = Tokenizer.fit(text)
    val = torch.tensor(tok.encode(text[-40_000:]))
    x, y = key_windows(val, tok, 200, 128)
    good = key_scores(_LastDigit(tok), x, y, batch=16)
    assert good["key_accuracy"] == 1.0 and good["key_loss"] < 1e-3 and good["key_windows"] == 200
    guess = key_scores(_LastDigit(tok, constant=tok.encode("4")[0]), x, y)
    assert 0.03 < guess["key_accuracy"] < 0.2
    assert guess["key_loss"] > math.log(10)  # confidently wrong nine times in ten


def test_windows_that_cannot_hold_the_record_are_skipped(text):
    tok = Tokenizer.fit(text)
    val = torch.tensor(tok.encode(text[-20_000:]))
    x, y = key_windows(val, tok, 8, 16)  # only records with 10-12 filler letters fit 16 tokens
    for row, answer in zip(x.tolist(), y.tolist()):
        assert re.findall(r"(\d):", tok.decode(row))[-1] == tok.decode([answer])  # the key digit is in view


def _row(variant, lr, seed, acc, loss, stage="bracket", status="done", compressed=None):
    row = {"variant": variant, "lr": lr, "seed": seed, "stage": stage, "status": status, "steps": 10}
    if status == "done":
        row.update(key_accuracy=acc, key_loss=loss, final_val_loss=3.0 + loss / 100)
    if compressed is not None:
        row["compressed"] = compressed
    return row


def test_chosen_rate_is_the_lowest_key_loss_and_an_end_asks_for_the_next_rate_out():
    from qkmla.experiments.retrieval import chosen_rates

    rows = [_row("mla", 3e-4, 1, 0.1, 2.30), _row("mla", 1e-3, 1, 0.5, 1.2), _row("mla", 3e-3, 1, 0.1, 2.31),
            _row("mha", 3e-4, 1, 0.1, 2.31), _row("mha", 1e-3, 1, 0.1, 2.30), _row("mha", 3e-3, 1, 0.9, 0.3),
            _row("mha-qknorm", 3e-4, 1, 0.1, 2.3), _row("mha-qknorm", 1e-3, 1, 1.0, 0.0),
            _row("mha-qknorm", 3e-3, 1, None, None, status="non-finite")]
    chosen = chosen_rates(rows)
    assert chosen == {"mla": 1e-3, "mha-qknorm": 1e-3}  # mha's best is at the end: 1e-2 is asked for first
    rows += [_row("mha", 1e-2, 1, 0.95, 0.2)]
    assert "mha" not in chosen_rates(rows)  # 1e-2 is the best and at the end again: 3e-2 is asked for
    rows += [_row("mha", 3e-2, 1, 0.1, 2.3)]
    assert chosen_rates(rows)["mha"] == 1e-2


def test_plan_tries_the_new_rates_first_and_keeps_the_first_runs_names(tmp_path):
    from qkmla.experiments import Options
    from qkmla.experiments.retrieval import BRACKET, LR, VARIANTS, plan

    runs = plan(Options(tmp_path))
    assert len(runs) == len(VARIANTS) * len(BRACKET)  # no rate is chosen before its bracket is measured
    assert [r.labels["lr"] == LR for r in runs] == [False] * (len(runs) - len(VARIANTS)) + [True] * len(VARIANTS)
    assert {r.name for r in runs if r.labels["lr"] == LR} == {f"{v}_s1" for v in VARIANTS}
    assert {r.name for r in runs if r.labels["lr"] != LR} == {f"{v}_lr{lr:g}_s1" for v in VARIANTS
                                                             for lr in BRACKET if lr != LR}
    assert all(r.train["lr"] == r.labels["lr"] and r.train["seed"] == 1 for r in runs)


def test_report_reads_each_variant_at_its_chosen_rate_and_skips_failed_runs(tmp_path):
    from qkmla.experiments import Options
    from qkmla.experiments.retrieval import report

    def compressed(acc):
        return [{"format": "dense", "policy": None, "fraction": 1.0, "bytes_per_token": 312, "key_accuracy": acc,
                 "key_loss": 0.1, "kept": 1.0},
                {"format": "dense", "policy": "h2o", "fraction": 0.5, "bytes_per_token": 312, "key_accuracy": acc / 2,
                 "key_loss": 2.0, "kept": 0.52}]
    rows = [_row("mha", 3e-3, 1, 0.1, 2.3), _row("mha", 1e-3, 1, 0.1, 2.31),
            _row("mla", 3e-3, 1, 0.2, 2.0, compressed=compressed(0.2)),
            _row("mla", 1e-3, 1, 1.0, 0.1, compressed=compressed(1.0)),
            _row("mla", 1e-3, 2, 0.5, 1.0, stage="seed", compressed=compressed(0.5)),
            _row("mla", 1e-3, 3, None, None, stage="seed", status="failed")]
    out = report(rows, Options(tmp_path, quick=True))
    mla, mha = out.summary["mla"], out.summary["mha"]
    assert out.summary["chosen_lr"] == {"mha": 3e-3, "mla": 1e-3}
    assert (mla["seeds"], mla["runs"], mla["compressed_seeds"]) == (2, 3, 2)  # the 3e-3 run is not averaged in
    assert mla["key_accuracy"] == 0.75 and mla["key_accuracy_per_seed"] == [1.0, 0.5]
    assert [c["key_accuracy"] for c in mla["compressed"]] == [0.75, 0.375]
    assert mla["bracket"]["0.003"]["key_accuracy"] == 0.2 and mha["seeds"] == 1 and "compressed" not in mha
    assert out.summary["mha-qknorm"]["lr"] is None  # no bracket yet
    assert "| mla | 1.000, 0.100* | 0.200, 2.000 |" in out.table
    assert "| h2o 0.5 | 0.520 | 0.375 |" in out.table and (tmp_path / "retrieval.png").is_file()
