import pytest

pytest.importorskip("torchtitan")

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.config.override import apply_overrides  # noqa: E402

from qkmla.integrations.torchtitan.attention import QKAttention  # noqa: E402
from qkmla.integrations.torchtitan.clip import QKClipOptimizersContainer  # noqa: E402
from qkmla.integrations.torchtitan.data import ByteTokenizer, LocalTextDataLoader  # noqa: E402
from qkmla.integrations.torchtitan.flavors import materialize  # noqa: E402
from qkmla.integrations.torchtitan.inner import DenseMaskAttention  # noqa: E402
from qkmla.integrations.torchtitan.metrics import MaxLogitMetricsProcessor  # noqa: E402

NAMES = ["qkmla_cpu", "qkmla_cpu_qk_norm", "qkmla_cpu_qk_clip", "qkmla_h200", "qkmla_h200_qk_norm",
         "qkmla_h200_qk_clip"]
OVERRIDE = "qkmla.integrations.torchtitan.overrides.qk_norm"


def parsed(*args):
    config = ConfigManager().parse_args(["--module", "qkmla.integrations.torchtitan", *args])
    apply_overrides(config.override, config)
    return config


@pytest.mark.parametrize("name", NAMES)
def test_each_config_is_found_by_torchtitans_parser_and_applies_its_arm(name):
    config = parsed("--config", name)
    assert type(config.tokenizer) is ByteTokenizer.Config and type(config.dataloader) is LocalTextDataLoader.Config
    assert config.validator.dataloader.split == "val" and config.dataloader.split == "train"
    assert type(config.metrics) is MaxLogitMetricsProcessor.Config
    attention = config.model_spec.model.layers[0].attention
    assert type(attention) is QKAttention.Config
    assert (attention.qk_norm is not None) == name.endswith("qk_norm")
    assert (attention.qk_clip_tau == 100) == name.endswith("qk_clip")
    assert (type(config.optimizer) is QKClipOptimizersContainer.Config) == name.endswith("qk_clip")
    cpu = "_cpu" in name
    assert (type(attention.inner_attention) is DenseMaskAttention.Config) == cpu
    assert config.training.disable_cuda_graphs == cpu and config.compile.enable != cpu


@pytest.mark.parametrize("options", ['{"kind": "rms"}', '{"kind": "l2", "learnable_logit_scale": true}',
                                     '{"kind": "lp", "p": 3, "mode": "unified"}', '{"scope": "projection"}',
                                     '{"mode": "content", "track_max_logits": true}'])
def test_every_norm_builds_a_model_torchtitans_trainer_accepts(options):
    """torchtitan's Trainer refuses a model holding a plain nn.Module (verify_module_protocol):
    qkmla's norms and meter are torchtitan Modules, initialized by its init_states."""
    config = parsed("--config", "qkmla_cpu_qk_norm", "--override.imports", f"{OVERRIDE}={options}")
    model = materialize(config.model_spec.model)
    model.verify_module_protocol()
    layer = model.layers["1"].attention
    assert all(bool((w == 1).all()) for w in layer.q_head_norm.parameters())
    assert float(layer.running_max_logits.max()) == float("-inf")
