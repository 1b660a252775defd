"""utils.checked's predicates: the one place that says a bool is not a number or a count, and a
string is not a switch (every constructor's checks go through them)."""

import numpy as np
import pytest
import torch

from qkmla.utils.checked import check_bool, check_size, is_int, is_number


@pytest.mark.parametrize("value, number, integer", [
    (3, True, True), (0, True, True), (-2, True, True), (2**70, True, True),
    (1.5, True, False), (float("nan"), True, False),
    (True, False, False), (False, False, False),
    ("3", False, False), (None, False, False), (np.int64(3), False, False),
])
def test_numbers_and_counts_exclude_bools(value, number, integer):
    assert is_number(value) is number
    assert is_int(value) is integer


@pytest.mark.parametrize("value", [True, False])
def test_check_bool_takes_bools(value):
    check_bool("flag", value)


@pytest.mark.parametrize("value", ["no", "False", 0, 1, None, 1.0])
def test_check_bool_names_the_switch(value):
    with pytest.raises(ValueError, match=r"^flag: expected True or False, got "):
        check_bool("flag", value)


@pytest.mark.parametrize("value", [0, 3, np.int64(3), torch.tensor(3)])
def test_check_size_takes_integers(value):
    check_size("n", value, 0)


def test_check_size_takes_a_traced_size_as_it_is():
    """Under torch.jit.trace a shape is a 0-d tensor: not compared (it would be a constant of the trace)."""
    def f(x):
        check_size("n", torch.tensor(-1), 0)
        return x + 1
    torch.jit.trace(f, torch.ones(2), check_trace=False)


@pytest.mark.parametrize("value", [-1, True, 3.0, "3", None, torch.tensor(3.0), torch.tensor([3]), torch.tensor(-1)])
def test_check_size_names_the_argument(value):
    with pytest.raises(ValueError, match=r"^n: expected an int >= 0 \(tokens\), got "):
        check_size("n", value, 0, " (tokens)")
