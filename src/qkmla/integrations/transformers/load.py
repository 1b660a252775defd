"""Loading a transformers DeepSeek-V2/V3 checkpoint (a directory, or a hub repository) into a model
patched by qkmla as its config records (:func:`from_pretrained`): transformers' loading, then
``apply_latent_attention`` with the saved QK norm, then the norm's weights. A QK-normed checkpoint's
own architecture (``auto.QKNormDeepseekV3ForCausalLM``) loads through here too."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional, Union

import torch

from ...cache.eviction import EvictionPolicy
from ...ops.mla_decode.backends import check_backend
from ..hub.checkpoint import CONFIG, _open, checkpoint_dir, read_hf_config
from .cache import check_cache_settings
from .model import apply_latent_attention, check_not_offloaded
from ..hub.checkpoint import check_norm_tensors, check_routing, check_shards, transformers_config
from ..hub.record import CAUSAL_LMS, FAMILY_MODEL_TYPES, describe, recorded_groups, recorded_norm, stock_model_type

# transformers' causal LM of each family qkmla loads (DeepSeek-V2/V3's, and every family ``auto`` built
# QK-normed classes for: ``hub.record.CAUSAL_LMS``), and their QK-normed model types
_CLASSES = CAUSAL_LMS
_MODEL_TYPES = tuple(_CLASSES) + tuple(FAMILY_MODEL_TYPES.values())
# transformers' from_pretrained arguments that say where a checkpoint is: read here, where it is fetched
_HUB = ("revision", "cache_dir", "subfolder", "local_files_only", "token", "force_download", "proxies")


@functools.lru_cache(maxsize=None)
def _loading_class(base, config_class):
    """``base`` reading its config with ``config_class`` (qkmla's for a checkpoint of qkmla's model
    type), and whose loading does not report qkmla's norm weights as unexpected (they are loaded by
    :func:`from_pretrained` once the norm exists). Same name, so a later ``save_pretrained``
    records transformers' architecture (qkmla's config writes its own in its place)."""
    patterns = [r"self_attn\.(\d+\.)?q_norm\.", r"self_attn\.(\d+\.)?k_norm\.", r"self_attn\.(\d+\.)?logit_scale"]
    ignore = list(base._keys_to_ignore_on_load_unexpected or []) + patterns
    return type(base.__name__, (base,), {"_keys_to_ignore_on_load_unexpected": ignore, "config_class": config_class,
                                         "__module__": base.__module__, "__qualname__": base.__qualname__})


def _given_config(config):
    """A ``config`` argument as its norm is read: a config object, or the config.json a local path names (a
    checkpoint directory or the file itself). A path was not read here: a QK-normed checkpoint's config given
    for a plain checkpoint was refused as ``qk_norm``, an argument never passed, and a plain one given for a
    QK-normed checkpoint loaded without a word, where the same config as an object is refused. None for none,
    or a hub id (transformers fetches it)."""
    if config is None or not isinstance(config, (str, Path)):
        return config
    path = Path(config)
    if path.is_dir():
        return read_hf_config(path, "config")
    if path.is_file():
        return read_hf_config(path.parent, "config") if path.name == CONFIG else None
    return None


def _experts_for_dtype(model, asked) -> None:
    """A float64 MoE model's experts computed eagerly: transformers' default, grouped_mm, multiplies in float32,
    bfloat16 or float16 only, and a float64 checkpoint's first forward failed in torch ("Expected mat_a to be
    Float32, BFloat16 or Float16 matrix, got Double"; ``qkmla generate --hf``: an internal error). Asked for by
    name (``experts_implementation="grouped_mm"``), it is refused naming the argument."""
    if model.dtype != torch.float64 or getattr(model.config, "_experts_implementation", None) != "grouped_mm" \
            or not hasattr(model, "set_experts_implementation"):
        return
    if asked is not None:
        raise ValueError("experts_implementation: 'grouped_mm' multiplies in float32, bfloat16 or float16, and this "
                         "model is float64; pass experts_implementation='eager', or another dtype")
    model.set_experts_implementation("eager")


def from_pretrained(hf_dir: Union[str, Path], *, kv_format: str = "dense", policy: Optional[EvictionPolicy] = None,
                    decode_backend: str = "auto", **kwargs):
    """A transformers DeepSeek-V2/V3 checkpoint loaded by transformers and patched by qkmla as its
    config records (:func:`~qkmla.integrations.transformers.apply_latent_attention` with the saved QK
    norm, its weights loaded); a checkpoint transformers wrote itself loads as plain latent MLA.

    Args:
        hf_dir: a directory ``save_pretrained`` wrote (config.json, safetensors weights), or a Hugging
            Face hub repository id holding one.
        kv_format, policy, decode_backend: as in ``apply_latent_attention``.
        kwargs: where the checkpoint is, as transformers takes it (``revision``, ``cache_dir``,
            ``subfolder``, ``local_files_only``, ``token``, ``force_download``; a repository is fetched
            into the hub cache first, offline from the cache alone:
            :func:`~qkmla.integrations.hub.checkpoint.checkpoint_dir`), and the rest passed to
            transformers' ``from_pretrained`` (``dtype=``, ``device_map=``, ``config=`` a config
            object that records the checkpoint's norm, ...).

    Returns:
        the model, in eval mode as transformers returns it: transformers' DeepSeek class, whose config
        is qkmla's ``QKNormDeepseekV3Config`` (V2) when it has a norm; with ``output_loading_info=True``,
        (model, transformers' loading report), as transformers returns them.

    Raises:
        ValueError, before any weight is read: no config.json, a model type other than
        DeepSeek-V2/V3 (or qkmla's QK-normed ones), a recorded norm that is not valid, norm weights
        that disagree with the record (see :func:`check_norm_tensors`), a ``config`` that records
        another norm, an ``attn_implementation``, ``qk_norm`` or ``variant`` argument, a policy the
        checkpoint's recorded dtype cannot hold (``dtype="auto"``, the default), or a repository that cannot
        be fetched.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if kwargs.get("proxies") is not None:
        raise ValueError("proxies: the hub client takes proxies from the HTTP_PROXY / HTTPS_PROXY environment "
                         "variables; leave proxies out")
    if "attn_implementation" in kwargs:
        raise ValueError("attn_implementation: qkmla's latent attention replaces transformers' attention; "
                         "leave it out")
    if "qk_norm" in kwargs:  # was passed on to the model class's constructor: a TypeError from transformers
        raise ValueError("qk_norm: from_pretrained loads the QK norm the checkpoint records (none for a checkpoint "
                         "transformers wrote); to add one, convert the checkpoint (qkmla convert --qk-norm, "
                         "qkmla.convert.convert_checkpoint(src, out, qk_norm=...)), or load it with transformers "
                         "and call apply_latent_attention(model, qk_norm=...)")
    if kwargs.get("variant") is not None:
        # qkmla's checks read the checkpoint's model.safetensors (or its index) before transformers loads: with a
        # variant, transformers loads model.VARIANT.safetensors, so the checks read other files than the ones
        # loaded (or none: "has neither model.safetensors.index.json nor model.safetensors", the file beside it)
        raise ValueError(f"variant: qkmla's loader reads a checkpoint's own weights (model.safetensors or its "
                         f"index), not a variant's (model.{kwargs['variant']}.safetensors); load a variant with "
                         "transformers' AutoModelForCausalLM.from_pretrained(path, variant=...) (qkmla's QK-normed "
                         "architectures are registered with it), or save the weights without variant=")
    # "bfloat16" as transformers takes it, or a dtype; torch_dtype where dtype is None, as transformers reads them
    wanted = kwargs.get("dtype") if kwargs.get("dtype") is not None else kwargs.get("torch_dtype")
    check_cache_settings(kv_format, policy, None, getattr(torch, wanted, None) if isinstance(wanted, str) else wanted)
    check_backend(decode_backend, "decode_backend")
    hub = {k: kwargs.pop(k) for k in _HUB if k in kwargs}
    hub.pop("proxies", None)
    root = checkpoint_dir(hf_dir, **hub)
    if not root.is_dir():
        raise ValueError(f"hf_dir: {root} is not a directory")
    hf_config = read_hf_config(root)
    model_type = hf_config.get("model_type")
    if model_type is None:  # e.g. a qkmla training run's directory (as `qkmla generate --hf` says it)
        raise ValueError(f"hf_dir: {root / CONFIG} names no model_type, so it is not a transformers checkpoint "
                         "(a qkmla training run loads with qkmla.train.load_model(RUN), or samples with "
                         "`qkmla generate RUN`)")
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"hf_dir: {root / CONFIG} describes a {model_type!r} model; qkmla loads {_MODEL_TYPES}")
    if wanted is None or wanted == "auto":
        # transformers' default dtype, "auto", is the one config.json records: a reposition policy over a bfloat16
        # checkpoint was refused only after every weight was loaded (the check above cannot read "auto")
        given = kwargs.get("config")  # a config object passed is the one transformers reads "auto" from
        recorded = (getattr(given, "dtype", None) if given is not None and not isinstance(given, (str, Path))
                    else hf_config.get("dtype", hf_config.get("torch_dtype")))
        recorded = getattr(torch, recorded, None) if isinstance(recorded, str) else recorded
        check_cache_settings(kv_format, policy, None, recorded if isinstance(recorded, torch.dtype) else None)
    # named by the argument, as this function's other refusals are: the message began with the path alone
    norm = recorded_norm(hf_config, f"hf_dir: {root / CONFIG}")
    recorded_groups(hf_config, f"hf_dir: {root / CONFIG}")  # so too its groups, before the checks below read them
    config = _given_config(kwargs.get("config"))
    if config is not None and recorded_norm(config, "config") != norm:
        raise ValueError(f"config: records {describe(recorded_norm(config, 'config'))}, but {root / CONFIG} records "
                         f"{describe(norm)}; pass the checkpoint's own config, or none")
    files = check_norm_tensors(root, hf_config, norm)
    check_routing(transformers_config(root), root / CONFIG)  # else its first forward failed in torch.topk
    check_shards(root)  # a cut or missing shard named here, not as transformers' SafetensorError
    base = getattr(transformers, _CLASSES[stock_model_type(model_type)])
    # qkmla's own config class for its model types (``auto``, registered when this package is imported);
    # transformers' for a plain checkpoint, or a QK-normed one saved before qkmla had model types
    config_class = CONFIG_MAPPING[model_type]
    # transformers returns (model, its load report) for output_loading_info=True: the tuple reached the lines below
    # as the model ("__class__ assignment only supported for mutable types")
    with_info = bool(kwargs.get("output_loading_info"))
    try:
        model = _loading_class(base, config_class).from_pretrained(root, attn_implementation="eager", **kwargs)
    except RuntimeError as e:  # tensors whose shapes disagree with the config (transformers' load report)
        raise ValueError(f"hf_dir: {root} does not load as its config describes it: "
                         f"{str(e).strip().splitlines()[0][:300]}") from None
    model, info = model if with_info else (model, None)
    _experts_for_dtype(model, kwargs.get("experts_implementation"))
    check_not_offloaded(model, "device_map")
    model.__class__ = base  # the loading class only loads: the model is transformers' own (pickling, type checks)
    apply_latent_attention(model, qk_norm=norm, kv_format=kv_format, policy=policy, decode_backend=decode_backend)
    if str(hf_dir) != str(root):  # a hub repository (or a subfolder): named as transformers names it
        model.name_or_path = model.config.name_or_path = str(hf_dir)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for file in sorted(set(files.values())):
            with _open(root / file) as f:
                for name in (n for n, fl in files.items() if fl == file):
                    params[name].copy_(f.get_tensor(name))
    return (model, info) if with_info else model
