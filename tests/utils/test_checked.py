"""utils.checked's predicates: the one place that says a bool is not a number or a count, and a
string is not a switch (every constructor's checks go through them)."""

import dataclasses

import numpy as np
import pytest
import torch

from qkmla.utils.checked import check_bool, check_size, is_int, is_number, python_numbers


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


def test_configs_take_numpy_numbers_as_the_python_numbers_they_hold():
    """A sweep's values from an array: GPTConfig(n_layer=np.int64(2)) was refused as "n_layer: expected a
    positive int, got np.int64(2)". Each config now holds Python numbers, which its JSON takes, set at
    construction or (TrainConfig) after it; the checks still judge the number, and a NumPy bool stays a bool."""
    import dataclasses
    import json

    from qkmla.cache.size import CacheShape
    from qkmla.config import AttentionConfig, MLAConfig, QKNormConfig
    from qkmla.model.gpt import GPTConfig
    from qkmla.train.config import TrainConfig

    made = [GPTConfig(n_layer=np.int64(2), n_embd=np.int32(64)), MLAConfig(hidden_size=np.int64(64)),
            AttentionConfig(hidden_size=np.int64(64), num_heads=np.int8(4), num_kv_heads=np.uint16(2)),
            QKNormConfig(kind="lp", p=np.float32(3.0)),
            CacheShape(np.int64(2), 4, np.int64(16), 4, kv_lora_rank=np.int64(32), qk_rope_head_dim=np.int32(8)),
            TrainConfig(steps=np.int64(3), lr=np.float32(0.5), model_overrides={"n_head": np.int64(2)})]
    assert GPTConfig(n_layer=np.int64(2), n_embd=np.int32(64)) == GPTConfig(n_layer=2, n_embd=64)
    for config in made:
        for value in dataclasses.asdict(config).values():
            for v in value.values() if isinstance(value, dict) else (value,):
                assert type(v).__module__ != "numpy", (config, v)
        json.dumps(dataclasses.asdict(config))  # a NumPy int64 fails here: "not JSON serializable"
    train = made[-1]
    train.steps = np.int64(9)
    assert type(train.steps) is int and train.steps == 9 and train.lr == float(np.float32(0.5))
    overrides = {"n_head": np.int64(2)}
    TrainConfig(model_overrides=overrides)
    assert type(overrides["n_head"]) is np.int64  # the caller's dict is left as it is
    with pytest.raises(ValueError, match=r"n_layer: expected a positive int, got 0"):
        GPTConfig(n_layer=np.int64(0))
    with pytest.raises(ValueError, match=r"n_layer: expected a positive int, got True"):
        GPTConfig(n_layer=np.bool_(True))  # a switch where a count belongs, as True is
    # Review 15c: a NumPy bool where a switch belongs was refused ("expected True or False, got np.True_"), or taken
    # and then failed writing config.json; and rope_scaling's own config took no NumPy numbers.
    assert MLAConfig(rope_interleave=np.True_).rope_interleave is True
    switched = TrainConfig(model_overrides={"tie_embeddings": np.False_}, learnable_logit_scale=np.True_)
    assert switched.model_overrides["tie_embeddings"] is False and switched.learnable_logit_scale is True
    json.dumps(dataclasses.asdict(switched))
    from qkmla.rope import YarnScaling

    assert YarnScaling(np.float32(4.0), np.int64(4096), beta_fast=np.float32(32)) == YarnScaling(4.0, 4096)
    with pytest.raises(ValueError, match=r"lr: expected a finite number > 0, got nan"):
        TrainConfig(lr=np.float64("nan"))
    with pytest.raises(ValueError, match=r"steps: expected an int >= 1"):
        train.steps = np.int64(0)
    assert train.steps == 9


def test_python_numbers_leaves_python_values_alone():
    @dataclasses.dataclass
    class C:
        a: object = 1
        b: object = "x"
        c: object = None

    c = C(np.int64(4), np.float64(0.5), {"k": np.int16(3), "s": "t", "b": np.True_})
    python_numbers(c)
    assert (c.a, type(c.a), c.b, type(c.b), c.c) == (4, int, 0.5, float, {"k": 3, "s": "t", "b": True})
    assert type(c.c["b"]) is bool
    kept = C()
    python_numbers(kept)
    assert (kept.a, kept.b, kept.c) == (1, "x", None)
