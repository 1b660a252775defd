"""pytest plugin: transformers' own DeepSeek-V2/V3 model tests, with every DeepSeek model they build patched.

Loaded into a pytest run over a transformers source tree's test files (``-p qkmla_conformance``
with this folder on ``PYTHONPATH``; ``test_suite.py`` beside it starts such runs):

* every DeepSeek-V2/V3 model class transformers defines (``*Model``, ``*ForCausalLM``, and any
  head the installed version has) gets its ``__init__`` wrapped: when the outermost model's
  constructor returns, ``apply_latent_attention`` patches it. That covers ``model_class(config)``
  in the model tester, ``from_pretrained`` (which builds the model on the meta device, then
  loads the weights into the patched model: transformers' own loading path) and
  ``from_config``. A head the adapter does not take (sequence or token classification) is
  left stock and counted, so a run says how much it covered.
* ``QKMLA_CONFORMANCE=stock`` loads the plugin without patching: the same run, for the stock
  pass count the patched one is compared with.
* the tests in :data:`EXPECTED_FAILURES` inspect transformers' own attention class or
  attention implementations, which the patched model replaces by design; they are marked
  ``xfail(strict=False)`` with their reason in a patched run.

transformers' root ``conftest.py`` is not loaded (the run passes ``--confcutdir`` at the tree's
``tests`` folder): it registers a plugin that needs pytest-xdist. The markers it and
transformers' pyproject.toml declare are declared here.
"""

from __future__ import annotations

import functools
import os
import threading

import pytest

MODE = os.environ.get("QKMLA_CONFORMANCE", "patched")

# test name (the function, without parametrisation) -> why it cannot pass on a patched model.
# Tests that look at transformers' own attention class, its config setter or switch attention
# implementations.
EXPECTED_FAILURES = {
    "test_can_set_attention_dynamically": "switches the model to transformers' attention implementations "
                                          "(set_attn_implementation), which a patched model refuses by design",
    "test_can_set_attention_dynamically_composite_model": "as test_can_set_attention_dynamically",
    "test_attn_implementation_composite_models": "reads config._attn_implementation, which is qkmla_latent",
    "test_sdpa_can_dispatch_non_composite_models": "asserts config._attn_implementation == 'sdpa'",
    "test_sdpa_can_dispatch_composite_models": "asserts config._attn_implementation == 'sdpa'",
    "test_torch_export": "traces transformers' attention-interface dispatch",
    "test_attention_outputs": "sets config.output_attentions = True on the patched model's config, and "
                              "transformers' PretrainedConfig setter refuses that for any attn_implementation but "
                              "'eager' (a patched model's is 'qkmla_latent'); the test's first half, "
                              "output_attentions=True per call, gets every layer's weights",
}

_state = threading.local()
PATCHED: list[str] = []
LEFT_STOCK: list[str] = []


def _deepseek_classes():
    import transformers

    names = [n for n in dir(transformers) if n.startswith(("DeepseekV2", "DeepseekV3"))
             and not n.endswith(("Config", "PreTrainedModel"))]
    classes = [getattr(transformers, n) for n in names]
    return [c for c in classes if isinstance(c, type) and issubclass(c, transformers.PreTrainedModel)]


def _wrap(cls):
    init = cls.__dict__["__init__"]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        depth = getattr(_state, "depth", 0)
        _state.depth = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            _state.depth = depth
        if depth == 0:
            _patch(self)

    cls.__init__ = __init__


def _patch(model) -> None:
    from qkmla.integrations.transformers import apply_latent_attention
    from qkmla.integrations.transformers.patched import SUPPORTED

    if type(model).__name__ not in SUPPORTED:
        LEFT_STOCK.append(type(model).__name__)
        return
    apply_latent_attention(model)
    PATCHED.append(type(model).__name__)


def pytest_configure(config):
    for marker in ("generate", "is_training_test", "torch_compile_test", "torch_export_test", "flash_attn_test",
                   "flash_attn_3_test", "kernels", "bitsandbytes", "is_pipeline_test", "is_staging_test",
                   "accelerate_tests", "agent_tests", "not_device_test", "training_ci", "tensor_parallel_ci",
                   "fsdp_ci", "expert_parallel_ci", "is_tensor_parallel_test", "flash_attn_4_test",
                   "all_flash_attn_test"):
        config.addinivalue_line("markers", f"{marker}: declared by transformers' conftest.py or pyproject.toml")
    if MODE == "patched":
        for cls in _deepseek_classes():
            if "__init__" in cls.__dict__:
                _wrap(cls)


def expected_failure(name: str):
    """The reason test ``name`` (parametrised names included: ``test_x_0_y``, ``test_x[...]``) is
    expected to fail patched, or None."""
    return next((why for test, why in EXPECTED_FAILURES.items()
                 if name == test or name.startswith((test + "_", test + "["))), None)


def pytest_collection_modifyitems(config, items):
    if MODE != "patched":
        return
    for item in items:
        reason = expected_failure(item.name)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=f"qkmla: {reason}", strict=False))


def pytest_terminal_summary(terminalreporter):
    if MODE == "patched":
        stock = sorted(set(LEFT_STOCK))
        terminalreporter.write_line(f"qkmla conformance: patched {len(PATCHED)} model(s); left stock "
                                    f"{len(LEFT_STOCK)} ({', '.join(stock) or 'none'})")
    else:
        terminalreporter.write_line("qkmla conformance: stock run (QKMLA_CONFORMANCE=stock), nothing patched")
