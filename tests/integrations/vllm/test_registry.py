"""What the plugin registers with vLLM, and the vLLM releases it accepts (no engine: vLLM's
``ModelConfig`` reads each checkpoint as an engine would)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")
pytest.importorskip("transformers")

from qkmla.integrations.vllm import check_vllm_version, register  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import NORMED, as_written_before_its_own_architecture, tiny_checkpoint  # noqa: E402


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.1.dev12+g0123abc"])
def test_a_supported_vllm_release_is_accepted(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.33.0", "0.31.2", "1.32.0", "0.320.0", "dev", ""])
def test_another_vllm_release_is_refused_in_one_line_naming_both(version):
    with pytest.raises(RuntimeError) as refused:
        check_vllm_version(version)
    message = str(refused.value)
    assert "\n" not in message
    assert f"vLLM {version} is installed" in message and "supports vLLM 0.32.x (tested with 0.32.0)" in message


def test_register_refuses_another_vllm_before_touching_vllms_internals(monkeypatch):
    """vLLM 0.33 calls the backend's cache write with a seventh argument (skip_scale), one of the
    internals that change between releases: the entry point refuses it before registering anything."""
    from vllm import ModelRegistry
    from vllm.transformers_utils import model_arch_config_convertor as convertors

    registered = []
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setattr(ModelRegistry, "register_model", lambda *a, **kw: registered.append(a))
    before = dict(convertors.MODEL_ARCH_CONFIG_CONVERTORS)
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x .* vLLM 0\.33\.0 is installed"):
        register()
    assert registered == [] and convertors.MODEL_ARCH_CONFIG_CONVERTORS == before


def model_config(path: Path):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(path), dtype="float32", max_model_len=128, skip_tokenizer_init=True)


def test_vllm_reads_each_checkpoint_as_its_own_architecture(tmp_path):
    """With the plugin registered: a QK-normed checkpoint is qkmla's architecture, read as DeepSeek's MLA
    (vLLM's latent cache); a plain one is vLLM's DeepSeek (test_engine.py: served as without the
    plugin); one written before the architecture of its own is qkmla's too."""
    from vllm.model_executor.models import ModelRegistry

    register()
    register()  # idempotent, as vLLM may load plugins more than once
    normed = tiny_checkpoint(tmp_path / "v3", **NORMED["v3-rms-blockwise-learned-scale"])
    v2 = tiny_checkpoint(tmp_path / "v2", **NORMED["v2-yarn-no-q-lora-lp3-unified"])
    before = as_written_before_its_own_architecture(tiny_checkpoint(tmp_path / "before", qk_norm="rms"))
    for path, architecture, model_type in [(normed, "QKNormDeepseekV3ForCausalLM", "qkmla_deepseek_v3"),
                                           (v2, "QKNormDeepseekV2ForCausalLM", "qkmla_deepseek_v2"),
                                           (before, "QKNormDeepseekV3ForCausalLM", "deepseek_v3")]:
        config = model_config(path)
        assert config.hf_config.model_type == model_type
        assert config.architectures == config.hf_config.architectures == [architecture]  # both read by vLLM
        assert config.is_deepseek_mla and config.use_mla and config.get_head_size() == 512 + 64
        cls, arch = ModelRegistry.resolve_model_cls(config.architectures, config)
        assert (cls.__module__, cls.__name__, arch) == ("qkmla.integrations.vllm.model", architecture, architecture)
    config = model_config(tiny_checkpoint(tmp_path / "plain"))
    assert (config.architectures, config.is_deepseek_mla, config.get_head_size()) == (["DeepseekV3ForCausalLM"],
                                                                                      True, 512 + 64)
    assert config.hf_config.architectures == ["DeepseekV3ForCausalLM"]
    cls, _ = ModelRegistry.resolve_model_cls(config.architectures, config)
    assert (cls.__module__, cls.__name__) == ("vllm.model_executor.models.deepseek_v2", "DeepseekV3ForCausalLM")
