"""qkmla.experiments.results: t p-values and quantiles against tabled values, Holm's
adjustment, paired_test's interval, a family of paired tests and its table, and the late max
logit."""

import math

import pytest

from qkmla.experiments.results import (
    family_table,
    holm,
    max_logit_late,
    paired_family,
    paired_test,
    t_quantile,
    t_two_sided_p,
)


@pytest.mark.parametrize("t, df, p", [(2.447, 6, 0.05), (2.262, 9, 0.05), (3.707, 6, 0.01), (1.0, 1, 0.5),
                                      (1.96, 10**6, 0.05)])
def test_t_p_values_match_tables(t, df, p):
    assert t_two_sided_p(t, df) == pytest.approx(p, abs=2e-4)
    assert t_two_sided_p(-t, df) == t_two_sided_p(t, df)


def test_t_quantile_inverts_the_p_value():
    assert t_quantile(0.975, 6) == pytest.approx(2.4469, abs=1e-4)
    assert t_quantile(0.975, 11) == pytest.approx(2.2010, abs=1e-4)
    assert t_two_sided_p(t_quantile(0.9, 4), 4) == pytest.approx(0.2, abs=1e-9)
    with pytest.raises(ValueError, match="q: expected"):
        t_quantile(0.4, 3)


def test_holm_steps_down_and_stays_monotone():
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03}) == pytest.approx({"a": 0.03, "c": 0.06, "b": 0.06})
    assert holm({"a": 0.5, "b": 0.6}) == {"a": 1.0, "b": 1.0}


def test_paired_test_interval_covers_the_mean_by_the_t_quantile():
    diffs = [0.1, 0.3, 0.2, 0.4]
    r = paired_test(diffs)
    se = r["sd"] / 2
    assert r["ci"] == pytest.approx([0.25 - t_quantile(0.975, 3) * se, 0.25 + t_quantile(0.975, 3) * se])
    assert r["p"] == pytest.approx(t_two_sided_p(0.25 / se, 3)) and 0 < r["p"] < 0.05
    assert math.isclose(r["t"], 0.25 / se)
    with pytest.raises(ValueError, match="at least 2"):
        paired_test([0.1])


def test_a_paired_family_waits_for_every_seed_then_tests_with_holm_and_tables_each_pair():
    rows = {"a": {1: {"x": 1.0}, 2: {"x": 2.0}, 3: {"x": 3.5}},
            "b": {1: {"x": 0.5}, 2: {"x": 1.0}, 3: {"x": 2.0}},
            "c": {1: {"x": 1.5}, 2: {"x": 2.5}, 3: {"x": 4.0}},
            "d": {1: {"x": 0.0}, 2: {"x": 1.5}, 3: {"x": 2.0}}}
    pairs = (("a", "b"), ("a", "c"), ("a", "d"))
    pending = paired_family({**rows, "b": {1: rows["b"][1]}}, pairs, "x", (1, 2, 3))
    assert pending == {"status": "pending", "seeds_in": {"a - b": 1, "a - c": 3, "a - d": 3}, "seeds_needed": 3}
    assert family_table(pending).startswith("pending: seeds in {'a - b': 1, 'a - c': 3, 'a - d': 3} of 3")
    done = paired_family(rows, pairs, "x", (1, 2, 3))
    ab, ac, ad = (done["tests"][f"a - {b}"] for b in "bcd")
    assert ab["diffs"] == [0.5, 1.0, 1.5] and ad["diffs"] == [1.0, 0.5, 1.5]
    assert ab["holm_p"] == ad["holm_p"] == pytest.approx(2 * ab["p"])  # Holm over the two tests, not three
    assert ac == {"n": 3, "mean": -0.5, "degenerate": True}  # the same on every seed: no t test, out of Holm
    text = family_table(done).splitlines()
    assert text[0] == "| a - b | n | mean ± se | 95% interval | p | Holm p | - / + |" and len(text) == 5
    assert text[2].startswith(f"| a - b | 3 | +1.00000 ± {ab['se']:.5f} |") and text[2].endswith("| 0 / 3 |")
    assert text[3] == "| a - c | 3 | -0.50000 on every seed | – | – | – | – |"


def test_max_logit_late_is_the_mean_over_the_last_tenth_of_the_logged_steps():
    rows = [{"step": i, "max_logit": float(i)} for i in range(20)] + [{"step": 20, "max_logit": None}]
    assert max_logit_late(rows) == 18.5  # steps 18 and 19; the null (non-finite) one skipped
    assert max_logit_late([{"step": 0, "loss": 1.0}]) is None
