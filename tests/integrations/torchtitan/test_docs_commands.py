import shlex
from pathlib import Path

import pytest

pytest.importorskip("torchtitan")

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.config.override import apply_overrides  # noqa: E402

from qkmla.integrations.torchtitan.attention import QKAttention  # noqa: E402
from qkmla.integrations.torchtitan.clip import QKClipOptimizersContainer  # noqa: E402
from qkmla.integrations.torchtitan.metrics import MaxLogitMetricsProcessor  # noqa: E402

PAGE = Path(__file__).resolve().parents[3] / "docs" / "torchtitan.md"


def commands() -> list[list[str]]:
    """torchtitan's arguments (after ``-m torchtitan.train``) of each torchrun line on the page."""
    lines = [line for line in PAGE.read_text().splitlines() if line.startswith("torchrun ")]
    return [shlex.split(line.split("-m torchtitan.train", 1)[1]) for line in lines]


IDS = ["qk_norm", "qk_norm l2", "qk_clip", "registry qk_norm", "registry qk_norm l2"]


def test_the_page_has_its_five_command_lines():
    assert len(commands()) == len(IDS)


@pytest.mark.parametrize("args", commands(), ids=IDS)
def test_each_documented_command_line_parses_and_applies_its_overrides(args):
    """The page's exact arguments through torchtitan's own CLI parser and override mechanism."""
    config = ConfigManager().parse_args(args)
    apply_overrides(config.override, config)
    layers = config.model_spec.model.layers
    assert all(type(layer.attention) is QKAttention.Config for layer in layers)
    assert type(config.metrics) is MaxLogitMetricsProcessor.Config
    attention = layers[0].attention
    if "qk_clip" in " ".join(args):
        assert attention.qk_clip_tau == 100 and attention.qk_norm is None
        assert type(config.optimizer) is QKClipOptimizersContainer.Config
    else:
        assert attention.qk_norm.kind == ("l2" if '"l2"' in " ".join(args) else "rms")
        assert attention.qk_norm.learnable_logit_scale == ('"l2"' in " ".join(args))
