"""Settings that stay valid after construction.

A configuration is checked once, when it is made; a field set afterwards (``pol.budget = 0``,
``config.grad_clip = -1.0``) would skip those checks and run with a value the constructor
refuses. Two ways to close that door, one per kind of object:

* :func:`revalidated` (a dataclass whose ``__post_init__`` checks every field, such as
  ``TrainConfig``): a field set after construction re-runs every check, and a refused change
  is undone before the ``ValueError`` (naming the field) is raised. New fields are covered as
  soon as ``__post_init__`` checks them.
* :class:`Frozen` (an object with no settings that may change, such as an eviction policy):
  setting any attribute after construction raises ``AttributeError`` naming it.
* :class:`FixedSettings` (an object whose state changes as it works but whose settings were
  used to build it, such as the transformers adapter's cache: its layers are made from
  ``kv_format``, ``policy`` and ``max_cache_len``): setting one of ``fixed_settings`` after
  construction raises ``AttributeError`` naming it; a changed setting would otherwise be read by
  nothing (``cache.max_cache_len = 2`` and the cache went on growing) or by some code only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import torch

def is_number(value) -> bool:
    """An int or a float, not a bool: Python counts True as the int 1, so a switch given where a
    number belongs (``softmax_scale=True``) passed ``isinstance(value, (int, float))`` as 1.0."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    """:func:`is_number` and finite. An int past a float's range (``10**400``) is not: the checks use this
    number as a float, and ``math.isfinite`` on it raised a bare OverflowError ("int too large to convert
    to float") where the argument's own refusal belongs."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_int(value) -> bool:
    """An int, not a bool: ``isinstance(True, int)`` holds, so a switch given where a count belongs
    (``workers=True``) passed as 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def as_int(value):
    """``value`` as a Python int when it is an integer of another kind (a NumPy int, as ``np.int64(8)`` from
    array arithmetic), else ``value`` itself, for the checks to judge. A cache's sizes pass through here:
    ``LatentCache(np.int64(2), ...)`` was refused as "expected a positive int, got np.int64(2)", a
    refusal that contradicts itself (configs: :func:`python_numbers`). A bool stays a bool: a switch
    where a size belongs is refused by the checks."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return value


def python_numbers(config) -> None:
    """Replace NumPy numbers and Fractions among a dataclass ``config``'s fields (and in a dict field's values, as
    ``model_overrides``) with the Python int or float they hold; first thing in a config's
    ``__post_init__``, so the checks judge the number. ``GPTConfig(n_layer=np.int64(2))`` (a sweep's
    values from an array) was refused as "expected a positive int, got np.int64(2)", a refusal that
    contradicts itself; kept, a NumPy int would fail later, where the config is written as JSON. A
    NumPy bool becomes a bool (``np.True_`` was refused as "expected True or False", or taken and then
    failed writing config.json); where a number belongs, the checks refuse it as they refuse True."""

    def plain(value):
        if type(value).__module__ != "numpy":
            # A Fraction is the number it holds too, as H2O's kept_fraction and RotaryEmbedding's theta take it:
            # GPTConfig(dropout=Fraction(1, 10)) was refused as "expected a number in [0, 1), got Fraction(1, 10)"
            return as_number(value) if isinstance(value, numbers.Real) else value
        if type(value).__name__ in ("bool", "bool_"):  # numpy.bool (numpy.bool_ before NumPy 2)
            return bool(value)
        return as_number(value)

    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, dict):  # a new dict: the caller's own is left as it is
            if any(plain(v) is not v for v in value.values()):
                object.__setattr__(config, field.name, {k: plain(v) for k, v in value.items()})
        elif plain(value) is not value:
            object.__setattr__(config, field.name, plain(value))  # a frozen dataclass too, as its __init__ does


def as_number(value):
    """``value`` as a Python int or float when it is a number of another kind (a NumPy scalar, a
    Fraction), else ``value`` itself, for the checks to judge (:func:`as_int` for the integers). A bool
    stays a bool; a number past a float's range (``Fraction(10**400)``) stays as it is, to be refused
    naming its argument, not as a bare OverflowError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        return float(value)
    except OverflowError:
        return value


INT64_MAX = 2 ** 63 - 1


def check_size(name: str, value, low: int, meaning: str = "") -> None:
    """A ValueError naming ``name`` unless ``value`` is an integer >= ``low`` (a Python or NumPy int, or
    a 0-d integer tensor, not a bool; ``meaning`` says what it counts). A size being traced is taken
    as it is, not compared: a SymInt (make_fx, torch.export), or a 0-d tensor under torch.jit.trace
    (which passes shapes as tensors); comparing one would add a guard, or fail, in the traced graph."""
    if isinstance(value, torch.SymInt):
        return
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not (
            value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        if torch.jit.is_tracing():
            return
        value = int(value)  # eager: compared as the int it holds
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}{meaning}, got {value!r}")
    if value > INT64_MAX:  # no tensor has such a size: torch.arange(2**63) failed with "cannot be converted to int64_t"
        raise ValueError(f"{name}: expected an int from {low} to 2**63 - 1{meaning}, got {value!r}")


# torch.manual_seed takes a seed up to 2**64 - 1, but the CPU generator (mt19937) keeps only its low 32
# bits: --seed 4294968633 trained, sampled and verified exactly as --seed 1337 did, a repeat said to be
# another seed (probe 19). A seed past 2**32 - 1 is refused rather than folded without a word.
SEED_MAX = 2 ** 32 - 1


def check_seed(name: str, value) -> None:
    """A ValueError naming ``name`` unless ``value`` is an int from 0 to :data:`SEED_MAX` (not a bool)."""
    if not is_int(value) or not 0 <= value <= SEED_MAX:
        raise ValueError(f"{name}: expected an int from 0 to 2**32 - 1 (torch's CPU generator keeps a seed's low "
                         f"32 bits: a larger one repeats a smaller one's run), got {value!r}")


def check_bool(name: str, value) -> None:
    """A ValueError naming ``name`` unless ``value`` is True or False: a switch given as a string
    (``rope_interleave="no"``, ``overwrite="no"``) is truthy, and was taken as True without a word."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True or False, got {value!r}")


# ids of the objects whose constructor is running: only they may set fields unchecked. (Kept
# out of the objects themselves, whose __dict__ callers may pass back as keyword arguments.)
_constructing: set = set()


def _constructed(init):
    """``init`` with the object marked as under construction while it runs."""

    @functools.wraps(init)
    def wrapped(self, *args, **kwargs):
        outermost = id(self) not in _constructing
        _constructing.add(id(self))
        try:
            init(self, *args, **kwargs)
        finally:
            if outermost:
                _constructing.discard(id(self))

    return wrapped


def revalidated(cls):
    """Class decorator for a dataclass whose ``__post_init__`` checks every field."""

    def __setattr__(self, name, value):
        if id(self) in _constructing:
            object.__setattr__(self, name, value)
            return
        missing = object()
        old = self.__dict__.get(name, missing)
        object.__setattr__(self, name, value)
        try:
            self.__post_init__()
        except BaseException:
            if old is missing:
                object.__delattr__(self, name)
            else:
                object.__setattr__(self, name, old)
            raise

    cls.__init__ = _constructed(cls.__init__)
    cls.__setattr__ = __setattr__
    return cls


class _FixedAfterConstruction:
    """What :class:`Frozen` and :class:`FixedSettings` share: the attributes ``_fixed`` names are set
    only while a constructor runs; afterwards setting or deleting one raises ``_refuse``'s error."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _constructed(cls.__dict__["__init__"])

    def _fixed(self, name: str) -> bool:
        raise NotImplementedError

    def _refuse(self, name: str):
        raise NotImplementedError

    def __setattr__(self, name, value):
        if self._fixed(name) and id(self) not in _constructing:
            self._refuse(name)
        super().__setattr__(name, value)

    def __delattr__(self, name):
        if self._fixed(name) and id(self) not in _constructing:
            self._refuse(name)
        super().__delattr__(name)


class Frozen(_FixedAfterConstruction):
    """Attributes are set only while a constructor runs; afterwards setting or deleting one
    raises ``AttributeError`` naming it."""

    def _fixed(self, name: str) -> bool:
        return True

    def _refuse(self, name: str):
        raise AttributeError(f"{name}: a {type(self).__name__} is fixed once its arguments are checked; make a new "
                             f"one with the value you want (its constructor checks it)")


class FixedSettings(_FixedAfterConstruction):
    """The attributes named in ``fixed_settings`` are set only while a constructor runs; any other
    attribute (the object's working state) stays free."""

    fixed_settings: tuple = ()

    def _fixed(self, name: str) -> bool:
        return name in self.fixed_settings

    def _refuse(self, name: str):
        raise AttributeError(f"{name}: a {type(self).__name__}'s settings are fixed once its arguments are checked "
                             "(what it holds was built from them); make a new one with the value you want")
