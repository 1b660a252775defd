"""Loading a transformers DeepSeek-V2/V3 checkpoint directory into a model patched by qkmla as
its config records (:func:`from_pretrained`): transformers' loading, then
``apply_latent_attention`` with the saved QK norm, then the norm's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from ...cache.eviction import EvictionPolicy
from ...ops.mla_decode.backends import check_backend
from ..hub.checkpoint import CONFIG, _open, read_hf_config
from .cache import check_cache_settings
from .model import apply_latent_attention
from ..hub.record import check_norm_tensors, recorded_norm

_CLASSES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


def _quiet_class(base):
    """``base`` whose loading does not report qkmla's norm weights as unexpected (they are
    loaded by :func:`from_pretrained` once the norm exists). Same name, so a later
    ``save_pretrained`` records transformers' architecture."""
    cached = getattr(base, "_qkmla_loading_class", None)
    if cached is None or cached.__dict__.get("_qkmla_base") is not base:
        patterns = [r"self_attn\.q_norm\.", r"self_attn\.k_norm\.", r"self_attn\.logit_scale"]
        ignore = list(base._keys_to_ignore_on_load_unexpected or []) + patterns
        cached = type(base.__name__, (base,), {"_keys_to_ignore_on_load_unexpected": ignore, "_qkmla_base": base,
                                               "__module__": base.__module__, "__qualname__": base.__qualname__})
        base._qkmla_loading_class = cached
    return cached


def from_pretrained(hf_dir: Union[str, Path], *, kv_format: str = "dense", policy: Optional[EvictionPolicy] = None,
                    decode_backend: str = "auto", **kwargs):
    """A transformers DeepSeek-V2/V3 checkpoint directory loaded by transformers and patched by
    qkmla as its config records (:func:`~qkmla.integrations.transformers.apply_latent_attention` with the saved QK
    norm, its weights loaded); a directory transformers wrote itself loads as plain latent MLA.

    Args:
        hf_dir: a directory ``save_pretrained`` wrote (config.json, safetensors weights).
        kv_format, policy, decode_backend: as in ``apply_latent_attention``.
        kwargs: passed to transformers' ``from_pretrained`` (``dtype=``, ``device_map=``, ...).

    Returns:
        the model, in eval mode as transformers returns it.

    Raises:
        ValueError, before any weight is read: no config.json, a model type other than
        DeepSeek-V2/V3, a recorded norm that is not valid, norm weights that disagree with the
        record (see :func:`check_norm_tensors`), or an ``attn_implementation`` argument.
    """
    import transformers

    root = Path(hf_dir)
    if not root.is_dir():
        raise ValueError(f"hf_dir: {root} is not a directory")
    hf_config = read_hf_config(root)
    model_type = hf_config.get("model_type")
    if model_type not in _CLASSES:
        raise ValueError(f"hf_dir: {root / CONFIG} describes a {model_type!r} model; qkmla loads {tuple(_CLASSES)}")
    if "attn_implementation" in kwargs:
        raise ValueError("attn_implementation: qkmla's latent attention replaces transformers' attention; "
                         "leave it out")
    check_cache_settings(kv_format, policy, None)
    check_backend(decode_backend, "decode_backend")
    norm = recorded_norm(hf_config, str(root / CONFIG))
    files = check_norm_tensors(root, hf_config, norm)
    base = getattr(transformers, _CLASSES[model_type])
    try:
        model = _quiet_class(base).from_pretrained(root, attn_implementation="eager", **kwargs)
    except RuntimeError as e:  # tensors whose shapes disagree with the config (transformers' load report)
        raise ValueError(f"hf_dir: {root} does not load as its config describes it: "
                         f"{str(e).strip().splitlines()[0][:300]}") from None
    model.__class__ = base  # the loading class only loads: the model is transformers' own (pickling, type checks)
    apply_latent_attention(model, qk_norm=norm, kv_format=kv_format, policy=policy, decode_backend=decode_backend)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for file in sorted(set(files.values())):
            with _open(root / file) as f:
                for name in (n for n, fl in files.items() if fl == file):
                    params[name].copy_(f.get_tensor(name))
    return model
