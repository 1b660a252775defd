"""QK-norm on a whole transformers DeepSeek model: what is recorded in its config, the names of its
weights, and the checks that a saved checkpoint's record and tensors agree (loading it back:
``hf_load.from_pretrained``).

``apply_latent_attention(model, qk_norm="rms")`` gives every attention layer qkmla's
post-up-projection QK norm and records it in the model's config, so that ``save_pretrained``
writes it to ``config.json``:

    "qkmla": {"qk_norm": "rms", "qk_norm_mode": "blockwise", "qk_norm_p": 2.0,
              "qk_norm_eps": 1e-06, "learnable_logit_scale": false}
    (and "qk_norm_scope": "projection" for a norm over the whole projection)
    "attn_implementation": "qkmla.integrations.transformers.from_pretrained"

The norm weights are saved as transformers names QK-norm weights (Qwen3's and OLMo 2's
``self_attn.q_norm.weight``), one level deeper because qkmla's norm has one weight per block:

    model.layers.{i}.self_attn.q_norm.content.weight   [d_n]   gamma_q^C
    model.layers.{i}.self_attn.q_norm.rope.weight      [d_r]   gamma_q^R
    model.layers.{i}.self_attn.k_norm.content.weight   [d_n]   gamma_k^C
    model.layers.{i}.self_attn.k_norm.rope.weight      [d_r]   gamma_k^R
    model.layers.{i}.self_attn.logit_scale             [h]     with learnable_logit_scale

With ``qk_norm_scope="projection"`` the weights have a row per head: q_norm's [h, d_n] and [h, d_r],
k_norm.content's [G, d_n] (k_norm.rope's stays [d_r]: the RoPE key is one vector).

Every other tensor is transformers' own, under its own name.

A model converted from a GQA model (``qkmla.convert.gqa``) has G < h KV groups, which
transformers' DeepSeek attention cannot express (it builds ``kv_b_proj`` with one group per
head). Its record then also holds ``"num_kv_groups": G``: ``kv_b_proj`` is saved with each
group's rows repeated for each of its heads, as transformers' shapes need, and the patched
layers keep (and cache) G groups (``hf_attention.LatentAttention``). The ``attn_implementation`` entry
is what stops transformers without qkmla from loading the directory as a plain DeepSeek model
(which would drop the norm weights with a note that they "can be ignored", and compute another
function): transformers refuses it, quoting the entry, which names the loader to call.

Nothing here imports transformers at module level.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from ...config import MLAConfig
from ...norms import qk_norms_of, variant_name
from .checkpoint import CONFIG, _open, _weight_map, read_hf_config

RECORD = "qkmla"  # the config.json entry
# written as attn_implementation: transformers alone refuses it
LOADER = "qkmla.integrations.transformers.from_pretrained"
NORM_FIELDS = ("qk_norm", "qk_norm_mode", "qk_norm_p", "qk_norm_eps", "learnable_logit_scale", "qk_norm_scope")
GROUPS = "num_kv_groups"  # recorded beside the norm by a GQA conversion: G < h KV groups
_DEFAULTS = {f: getattr(MLAConfig, f) for f in NORM_FIELDS} | {"qk_norm": None}


def norm_settings(qk_norm: Optional[str] = None, qk_norm_mode: str = "blockwise", qk_norm_p: float = 2.0,
                  qk_norm_eps: float = 1e-6, learnable_logit_scale: bool = False, qk_norm_scope: str = "head") -> dict:
    """The QK-norm fields of :class:`~qkmla.MLAConfig`, checked (ValueError naming the field), as
    the dict recorded in a model's config; {} for no norm and no learnable logit scale.
    ``qk_norm_scope`` is recorded only when it is not the default "head", so that checkpoints with
    a per-head norm keep the record earlier qkmla versions read."""
    fields = dict(qk_norm=qk_norm, qk_norm_mode=qk_norm_mode, qk_norm_p=qk_norm_p, qk_norm_eps=qk_norm_eps,
                  learnable_logit_scale=learnable_logit_scale, qk_norm_scope=qk_norm_scope)
    if not isinstance(learnable_logit_scale, bool):
        raise ValueError(f"learnable_logit_scale: expected True or False, got {learnable_logit_scale!r}")
    MLAConfig(**fields)  # validates each field by name
    if qk_norm is None:
        given = [f for f in ("qk_norm_mode", "qk_norm_p", "qk_norm_eps", "qk_norm_scope")
                 if fields[f] != _DEFAULTS[f]]
        if given:
            raise ValueError(f"{given[0]}: only read with a qk_norm; give qk_norm too (e.g. qk_norm='rms')")
    if qk_norm is None and not learnable_logit_scale:
        return {}
    if qk_norm_scope == "head":
        del fields["qk_norm_scope"]
    return {**fields, "qk_norm_p": float(qk_norm_p), "qk_norm_eps": float(qk_norm_eps)}


def recorded_norm(hf_config, where: str = "model.config") -> dict:
    """The QK-norm settings recorded in an HF config (object or config.json dict), checked; {} if none."""
    record = hf_config.get(RECORD) if isinstance(hf_config, dict) else getattr(hf_config, RECORD, None)
    if record is None:
        return {}
    if not isinstance(record, dict) or set(record) - set(NORM_FIELDS) - {GROUPS}:
        extra = sorted(set(record) - set(NORM_FIELDS) - {GROUPS}) if isinstance(record, dict) \
            else type(record).__name__
        raise ValueError(f"{where}: its {RECORD!r} entry must be a dict of {NORM_FIELDS + (GROUPS,)}, got {extra}")
    record = {k: v for k, v in record.items() if k != GROUPS}
    if not record:
        return {}
    try:
        return norm_settings(**{**_DEFAULTS, **record})
    except ValueError as e:
        raise ValueError(f"{where}: its {RECORD!r} entry is not valid: {e}") from None


def recorded_groups(hf_config, where: str = "model.config") -> Optional[int]:
    """The KV group count G a GQA conversion recorded in an HF config (object or config.json
    dict), checked against its num_attention_heads; None if none is recorded."""
    record = hf_config.get(RECORD) if isinstance(hf_config, dict) else getattr(hf_config, RECORD, None)
    groups = record.get(GROUPS) if isinstance(record, dict) else None
    if groups is None:
        return None
    heads = hf_config.get("num_attention_heads") if isinstance(hf_config, dict) else hf_config.num_attention_heads
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1 or heads % groups:
        raise ValueError(f"{where}: its {RECORD!r} entry records {GROUPS}={groups!r}, which must be a positive int "
                         f"dividing num_attention_heads={heads}")
    return groups


def record_norm(hf_config, norm: dict) -> None:
    """Write (or clear, for {}) the record of ``norm`` in an HF config object; a recorded
    ``num_kv_groups`` is kept."""
    groups = recorded_groups(hf_config)
    kept = {GROUPS: groups} if groups is not None else {}
    if norm:
        setattr(hf_config, RECORD, {**norm, **kept})
        hf_config.attn_implementation = LOADER
    else:
        for name in (RECORD, "attn_implementation"):
            if name in hf_config.__dict__:
                delattr(hf_config, name)
        if kept:  # a GQA conversion without a norm: transformers alone computes the same function
            setattr(hf_config, RECORD, kept)


def record_groups(hf_config, groups: int) -> None:
    """Record that a model's layers have ``groups`` KV groups (GQA conversions), beside any norm."""
    setattr(hf_config, RECORD, {**(getattr(hf_config, RECORD, None) or {}), GROUPS: groups})
    recorded_groups(hf_config)


def norm_tensor_shapes(config: MLAConfig) -> dict[str, tuple[int, ...]]:
    """{name under ``self_attn.``: shape} of the weights a layer with ``config``'s norm adds, read from
    the norms it builds (with the projection scope a weight has a row per query head or KV group)."""
    q_norm, k_norm = qk_norms_of(config)
    shapes = {f"{side}.{block}.weight": tuple(getattr(norm, block).weight.shape)
              for side, norm in (("q_norm", q_norm), ("k_norm", k_norm)) if norm is not None
              for block in ("content", "rope")}
    return shapes | ({"logit_scale": (config.num_heads,)} if config.learnable_logit_scale else {})


def check_norm_tensors(hf_dir: Union[str, Path], hf_config: dict, norm: dict) -> dict[str, str]:
    """Before any weight is read: the checkpoint holds exactly the norm weights its config records,
    with the right shapes (from the safetensors headers). Returns {tensor name: shard file}.

    Raises:
        ValueError: naming the file, for a norm recorded whose weights are missing, norm weights
            whose norm is not recorded, or a weight of the wrong shape.
    """
    from .config import mla_config_from_hf

    root = Path(hf_dir)
    weight_map, listing = _weight_map(root)
    ours = ("self_attn.q_norm.", "self_attn.k_norm.", "self_attn.logit_scale")
    found = {k for k in weight_map if any(o in k for o in ours)}
    groups = recorded_groups(hf_config, str(root / CONFIG))
    config = mla_config_from_hf(hf_config, **norm, **({GROUPS: groups} if groups is not None else {}))
    layers = hf_config.get("num_hidden_layers")
    shapes = {f"model.layers.{i}.self_attn.{n}": s
              for i in range(layers) for n, s in norm_tensor_shapes(config).items()}
    if not norm and found:
        raise ValueError(f"hf_dir: {listing} holds QK-norm weights ({sorted(found)[0]}, ...: {len(found)}) but "
                         f"{root / CONFIG} records no norm (its {RECORD!r} entry is missing); the config and the "
                         f"weights are from different models")
    records = {k for k in found if k.endswith("._extra_state")}  # the variant record of each norm (optional)
    found -= records
    missing, extra = sorted(set(shapes) - found), sorted(found - set(shapes))
    if missing or extra:
        raise ValueError(f"hf_dir: {root / CONFIG} records the norm {norm} but {listing} "
                         + (f"lacks {missing[:3]}{' ...' if len(missing) > 3 else ''} ({len(missing)} missing)"
                            if missing else f"also holds {extra[:3]} ({len(extra)} not of that norm)"))
    files = {}
    for name, shape in shapes.items():
        file = weight_map[name]
        if not (root / file).is_file():
            raise ValueError(f"hf_dir: {listing} names shard file {file}, which is not in {root}")
        with _open(root / file) as f:
            got = tuple(f.get_slice(name).get_shape())
        if got != shape:
            raise ValueError(f"hf_dir: {root / file}: {name} has shape {got}; the config in {root / CONFIG} needs "
                             f"{shape}")
        files[name] = file
    if records:
        want = _variant(norm) if norm.get("qk_norm") else None
        for name in sorted(records):
            with _open(root / weight_map[name]) as f:
                got = bytes(f.get_tensor(name).tolist()).decode("ascii", "replace")
            if got != want:
                raise ValueError(f"hf_dir: {root / weight_map[name]}: {name} says its weights belong to a {got} QK "
                                 f"norm, but {root / CONFIG} records {describe(norm)}")
    return files


def saved_norm(hf_dir: Union[str, Path]) -> dict:
    """The QK norm a checkpoint directory's config.json records ({} for none)."""
    root = Path(hf_dir)
    return recorded_norm(read_hf_config(root), str(root / CONFIG))


def _variant(norm: dict) -> str:
    """The variant name (``qkmla.norms.variant_name``) of a recorded norm with a qk_norm."""
    return variant_name(norm["qk_norm"], norm["qk_norm_p"], norm["qk_norm_mode"], norm.get("qk_norm_scope", "head"))


def describe(norm: dict) -> str:
    """One line naming a recorded norm, e.g. ``rms blockwise``."""
    if not norm:
        return "no QK norm"
    text = "no QK norm" if norm["qk_norm"] is None else _variant(norm)
    return text + (", learnable logit scale" if norm["learnable_logit_scale"] else "")


__all__ = ["GROUPS", "LOADER", "NORM_FIELDS", "RECORD", "check_norm_tensors", "describe", "norm_settings",
           "record_groups", "recorded_groups", "recorded_norm", "saved_norm"]
