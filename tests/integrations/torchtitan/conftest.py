"""Builders for the torchtitan tests; torchtitan is imported inside them, so that each test file's
``pytest.importorskip("torchtitan")`` skips it cleanly where the extra is not installed."""

import pytest
import torch

OVERRIDES = "qkmla.integrations.torchtitan.overrides."


def trainer_config(overrides=(), layers: int = 2):
    """torchtitan's own DeepSeek-V3 debug Trainer.Config (16 heads of 128 + 64, d_c 512), cut to
    ``layers`` layers (the first dense, then MoE), its inner attention the CPU one, with qkmla's
    overrides applied by torchtitan's own mechanism (``overrides``: names in ``overrides.py``, or
    (name, kwargs) pairs)."""
    from torchtitan.config import derive
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    from qkmla.integrations.torchtitan.inner import DenseMaskAttention

    config = deepseek_v3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:layers]
    for layer in model.layers:
        layer.attention.inner_attention = derive(layer.attention.inner_attention, DenseMaskAttention.Config)
    config.override = OverrideConfig(imports=[
        OVERRIDES + o if isinstance(o, str) else (OVERRIDES + o[0], o[1]) for o in overrides])
    apply_overrides(config.override, config)
    return config


def build(model_config, seed: int = 0):
    """A torchtitan model built as its Trainer builds one (meta device, then init_states), on the CPU."""
    from qkmla.integrations.torchtitan.flavors import materialize

    return materialize(model_config, "cpu", seed)


def packed_positions(batch: int, lengths: list[int]) -> torch.Tensor:
    """[batch, sum(lengths)] positions restarting at 0 at each packed document, as torchtitan's loader gives."""
    return torch.cat([torch.arange(n) for n in lengths]).expand(batch, -1)


def causal_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """torchtitan's logits [B, T, V] of one document per row at positions 0..T-1 (the causal mask the
    model builds, made without ``get_attention_masks``' torch.compile, which recompiles per length)."""
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import get_causal_mask_mod

    B, L = tokens.shape
    mask = create_block_mask(get_causal_mask_mod(), B, None, L, L, device="cpu")
    with torch.no_grad():
        return model(tokens, positions=torch.arange(L).expand(B, -1), attention_masks=mask)


@pytest.fixture
def tokens():
    torch.manual_seed(1)
    return torch.randint(0, 2048, (2, 24))


@pytest.fixture
def titan():
    """The builders above, for the tests (conftest modules are not imported by name)."""
    import types

    return types.SimpleNamespace(config=trainer_config, build=build, positions=packed_positions, logits=causal_logits)
