import pytest

pytest.importorskip("torchtitan")

from torchtitan.config.override import OverrideConfig, apply_overrides  # noqa: E402

from qkmla import QKNormConfig  # noqa: E402
from qkmla.integrations.torchtitan.attention import QKAttention  # noqa: E402
from qkmla.integrations.torchtitan.clip import QKClipOptimizersContainer  # noqa: E402
from qkmla.integrations.torchtitan.inner import DenseMaskAttention  # noqa: E402
from qkmla.integrations.torchtitan.metrics import MaxLogitMetricsProcessor  # noqa: E402
from qkmla.integrations.torchtitan.versions import check_torchtitan  # noqa: E402

P = "qkmla.integrations.torchtitan.overrides."


@pytest.mark.parametrize("kwargs, norm", [
    ({}, QKNormConfig()),
    ({"mode": "unified"}, QKNormConfig(mode="unified")),
    ({"kind": "l2", "learnable_logit_scale": True}, QKNormConfig("l2", learnable_logit_scale=True)),
    ({"kind": "lp", "p": 3}, QKNormConfig("lp", p=3.0)),
    ({"scope": "projection", "eps": 1e-5}, QKNormConfig(eps=1e-5, scope="projection")),
])
def test_qk_norm_replaces_every_deepseek_attention_through_torchtitans_overrides(titan, kwargs, norm):
    config = titan.config([("qk_norm", kwargs), "max_logit_metrics"], layers=3)
    layers = config.model_spec.model.layers
    assert all(type(layer.attention) is QKAttention.Config and layer.attention.qk_norm == norm for layer in layers)
    assert type(config.metrics) is MaxLogitMetricsProcessor.Config
    assert config.metrics.log_freq == 1  # derived: torchtitan's fields carried over
    # the CPU inner attention set before the override is kept (derive copies it)
    assert all(type(layer.attention.inner_attention) is DenseMaskAttention.Config for layer in layers)


def test_qk_clip_and_max_logits_set_up_the_layers_and_the_optimizer(titan):
    config = titan.config([("qk_clip", {"tau": 30.0}), "qk_clip_optimizer"])
    attention = config.model_spec.model.layers[0].attention
    assert attention.qk_clip_tau == 30.0 and attention.qk_norm is None
    assert type(config.optimizer) is QKClipOptimizersContainer.Config
    plain = titan.config(["max_logits"]).model_spec.model.layers[1].attention
    assert plain.track_max_logits and plain.qk_norm is None and plain.qk_clip_tau is None


@pytest.mark.parametrize("overrides, match", [
    ([("qk_norm", {"kind": "rmsnorm"})], r"qk_norm: kind: expected one of \(None, 'rms', 'l2', 'lp'\)"),
    ([("qk_norm", {"kind": None})], "qk_norm: kind: expected one of .*use the max_logits override"),
    ([("qk_norm", {"mode": "sideways"})], "qk_norm: mode: expected one of"),
    ([("qk_norm", {"kind": "lp", "p": 0.5})], "qk_norm: p: expected a finite number >= 1"),
    ([("qk_clip", {"tau": -1.0})], "qk_clip: tau: expected a finite positive threshold"),
    ([("qk_norm", {"kind": "l2", "learnable_logit_scale": True, "logit_scale_init": True})],
     "logit_scale_init: expected a finite positive number"),
    ([("qk_norm", {"track_max_logits": "yes"})], "track_max_logits: expected True or False"),
    ([("qk_norm", {"logit_scale_init": 3.0})], "logit_scale_init: only read with a learned logit scale"),
    (["qk_norm", "qk_clip"], "both claim node 'model_spec.model.layers.0.attention'"),
    (["qk_norm", "max_logits"], "both claim node"),
])
def test_bad_settings_are_refused_before_any_model_is_built(titan, overrides, match):
    with pytest.raises(ValueError, match=match):
        titan.config(overrides)


def test_qk_clip_with_a_qk_norm_is_refused_by_the_layer_config_too():
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    from torchtitan.config import derive

    attention = deepseek_v3_debugmodel().model_spec.model.layers[0].attention
    with pytest.raises(ValueError, match=r"qk_clip_tau: QK-Clip and a QK norm \(rms blockwise\) cannot be combined"):
        derive(attention, QKAttention.Config, qk_norm="rms", qk_clip_tau=100.0)


@pytest.mark.parametrize("module", ["llama3", "qwen3"])
def test_an_override_aimed_at_a_model_without_deepseek_attention_is_refused(module):
    import importlib

    registry = importlib.import_module(f"torchtitan.models.{module}.config_registry")
    config = getattr(registry, f"{module}_debugmodel")()
    for name in ("qk_norm", "qk_clip", "max_logits"):
        with pytest.raises(ValueError, match=rf"{name}: qkmla replaces torchtitan's DeepSeek-V3 MLA Attention .* "
                                             r"but this model's attention is"):
            apply_overrides(OverrideConfig(imports=[P + name]), config)


def test_another_overrides_mla_subclass_is_refused_not_silently_replaced():
    """A layer another override already made its own MLA subclass (torchtitan's fused_mla shows the
    case; here its config class is stood in for, since fused_mla needs a GPU Triton): refused."""
    from dataclasses import dataclass

    from torchtitan.config import derive
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
    from torchtitan.models.deepseek_v3.model import Attention

    from qkmla.integrations.torchtitan.overrides import qk_norm

    class Fused(Attention):
        @dataclass(kw_only=True, slots=True)
        class Config(Attention.Config):
            pass

    attention = derive(deepseek_v3_debugmodel().model_spec.model.layers[0].attention, Fused.Config)
    with pytest.raises(ValueError, match="this model's attention is .*Fused; another override already replaced it"):
        qk_norm(attention)


def test_the_clip_optimizer_without_clipping_layers_is_refused_when_built(titan):
    config = titan.config(["qk_clip_optimizer"])
    model = titan.build(config.model_spec.model)
    with pytest.raises(ValueError, match="optimizer: qkmla's qk_clip_optimizer override clips the layers that the "
                                         "qk_clip override set up, and this model has none"):
        config.optimizer.build(model_parts=[model])


@pytest.mark.parametrize("version, ok", [("0.3.0", True), ("0.3.7", True), ("0.3.1.dev20261101+cu130", True),
                                         ("0.2.2", False), ("0.4.0", False), ("1.0.0", False)])
def test_torchtitan_versions_outside_the_tested_range_are_refused_in_one_line(version, ok):
    if ok:
        assert check_torchtitan(version) == version
    else:
        with pytest.raises(ImportError, match=rf"supports torchtitan>=0.3.0,<0.4, found {version}; pip install"):
            check_torchtitan(version)



def test_a_rank_holding_a_slice_of_the_heads_is_refused_for_a_projection_scope_norm(titan, tokens):
    """Tensor parallelism gives each rank h / tp heads; a projection-scope norm pools one statistic
    over every head, which qkmla does not compute across ranks: refused at the first forward. (The
    slice is simulated: the layer is told it has twice the heads its projections give.) A learned
    logit scale is split by heads instead (test_trainer.py)."""
    import torch

    model = titan.build(titan.config([("qk_norm", {"scope": "projection"})]).model_spec.model)
    layer = model.layers["0"].attention
    layer.n_heads = 32
    with pytest.raises(ValueError, match=r"parallelism.tensor_parallel_degree: this layer has 16 of its 32 heads .*"
                                         r"scope 'projection'\) pool one statistic over every head"):
        layer(torch.randn(1, 8, 256), None, None)


@pytest.mark.parametrize("overrides", [["max_logits"], [("qk_clip", {"tau": 100})],
                                       [("qk_norm", {"track_max_logits": True})]])
def test_context_parallelism_is_refused_for_a_layer_that_measures_its_max_logits(titan, overrides):
    """Each rank would measure its shard of the sequence: refused when torchtitan parallelizes the
    layer, naming the setting; a QK-normed layer that does not measure is distributed as usual."""
    import types

    parallel = types.SimpleNamespace(cp_enabled=True, cp=2, spmd_backend="full_dtensor", resolve_mesh=lambda axes: None)
    layer = titan.build(titan.config(overrides).model_spec.model).layers["0"].attention
    with pytest.raises(ValueError, match=r"parallelism.context_parallel_degree: 2 splits the sequence"):
        layer._distribute_states(parallel)
    from torchtitan.protocols.sharding import ShardingConfig

    plain = titan.build(titan.config(["qk_norm"]).model_spec.model).layers["0"].attention
    plain._sharding_config = ShardingConfig(state_shardings={})  # torchtitan's update_from_config sets one
    plain._distribute_states(parallel)


def test_kimi_k2_5s_language_model_attention_is_replaced_and_its_vision_encoders_left_alone():
    """torchtitan's Kimi K2.5 / Moonlight models use DeepSeek-V3's MLA in the language model (its
    vision encoder names its attention ``attn``): qk_norm replaces every language-model layer, the
    vision encoder's attention stays, and the model passes the Trainer's module check. (Its config
    registry needs torchvision; its model registry does not.)"""
    import torch
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.kimi_k2_7 import model_registry
    from torchtitan.trainer import Trainer

    config = Trainer.Config(model_spec=model_registry("debugmodel"))
    config.override = OverrideConfig(imports=["qkmla.integrations.torchtitan.overrides.qk_norm"])
    apply_overrides(config.override, config)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    layers = [name for name, m in model.named_modules() if isinstance(m, QKAttention)]
    vision = [name for name, m in model.named_modules() if type(m).__name__ == "VisionAttention"]
    assert len(layers) == len(config.model_spec.model.layers) and all(n.endswith(".attention") for n in layers)
    assert vision and not any(isinstance(m, QKAttention) for n, m in model.named_modules() if "vision" in n)
    model.verify_module_protocol()
