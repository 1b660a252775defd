"""qkmla.utils.limits: sizes checked against the memory available before any work (issue 27, class 2)."""

import pytest

from qkmla.utils import limits


def test_available_bytes_is_a_plausible_amount():
    avail = limits.available_bytes()
    assert avail is None or 2**20 < avail < 2**50


def test_check_fits_refuses_only_what_exceeds_the_memory_available(monkeypatch):
    monkeypatch.setattr(limits, "available_bytes", lambda: 3 * 2**30)
    limits.check_fits("--tokens", 3 * 2**30, "the output")  # exactly what is there: accepted
    with pytest.raises(ValueError, match=r"--tokens: the output need at least 4 GiB, more than the 3 GiB of memory "
                                         r"available; use a smaller value"):
        limits.check_fits("--tokens", 4 * 2**30, "the output")
    monkeypatch.setattr(limits, "available_bytes", lambda: None)  # unknown: nothing is refused
    limits.check_fits("--tokens", 2**60, "the output")
