"""The paired tests of qkmla.experiments.results: t p-values and quantiles against tabled
values, Holm's adjustment, and paired_test's interval."""

import math

import pytest

from qkmla.experiments.results import holm, paired_test, t_quantile, t_two_sided_p


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
