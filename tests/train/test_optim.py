import pytest
import torch

from qkmla.model.gpt import GPT, GPT_PRESETS
from qkmla.train.optim import build_optimizer, lr_multiplier


def test_muon_takes_hidden_matrices_only():
    model = GPT(GPT_PRESETS["debug"])
    opt = build_optimizer(model, "muon", lr=1e-3, muon_adjust_lr="original")
    muon, adam = opt.optimizers
    assert isinstance(muon, torch.optim.Muon) and muon.defaults["adjust_lr_fn"] == "original"
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    assert id(model.wte.weight) not in muon_ids
    assert all(p.dim() == 2 for g in muon.param_groups for p in g["params"])
    assert id(model.blocks[0].attn.kv_b_proj.weight) in muon_ids
    adam_ids = {id(p) for g in adam.param_groups for p in g["params"]}
    assert id(model.wte.weight) in adam_ids and id(model.ln_f.weight) in adam_ids


def test_schedules():
    assert lr_multiplier(0, 100, "cosine", warmup_steps=10) == pytest.approx(0.1)
    assert lr_multiplier(10, 100, "cosine", warmup_steps=10) == pytest.approx(1.0)
    assert lr_multiplier(100, 100, "cosine", warmup_steps=10, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_multiplier(50, 100, "wsd", warmup_steps=10) == 1.0
    assert lr_multiplier(100, 100, "wsd", min_lr_ratio=0.0) == pytest.approx(0.0)
    assert lr_multiplier(90, 100, "wsd", min_lr_ratio=0.0, decay_shape="sqrt") == pytest.approx(1 - 0.5 ** 0.5)
    with pytest.raises(ValueError, match="schedule"):
        lr_multiplier(0, 10, "step")
    with pytest.raises(ValueError, match="optimizer"):
        build_optimizer(GPT(GPT_PRESETS["debug"]), "sgd")


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_decays_reach_min_lr_ratio_one_past_the_last_step(schedule):
    """What --min-lr-ratio's help says: the ratio is reached at step --steps, so the last step
    trained (0-based steps - 1) is one decay step above it, and no step after the warmup is below it."""
    steps = [lr_multiplier(s, 50, schedule, warmup_steps=5, min_lr_ratio=0.25) for s in range(51)]
    assert steps[50] == pytest.approx(0.25)
    assert 0.25 < steps[49] < 0.5 and min(steps[5:]) == pytest.approx(0.25)
    # a short decay ends well above it (review 15c): two cosine decay steps stop half way down
    assert lr_multiplier(21, 22, "cosine", warmup_steps=20, min_lr_ratio=0.0) == pytest.approx(0.5)
