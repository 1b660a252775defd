"""PEFT LoRA on the attention projections of a model ``apply_latent_attention`` patched.

    model = apply_latent_attention(DeepseekV3ForCausalLM.from_pretrained(path), qk_norm="rms")
    peft_model = peft.get_peft_model(model, attention_lora_config(model, r=16, train_qk_norm=True))
    ...                                       # train peft_model: a plain loop or transformers' Trainer
    model = merge_lora(peft_model)            # the patched model, its projections nn.Linear again
    model.generate(ids, max_new_tokens=64)    # absorbed decode through the latent cache

Training runs the explicit path, which calls every projection as a module, so an adapter on
any of them trains. Decoding is another matter for one of them: the absorbed path folds
``kv_b_proj.weight`` into the query and the output (W_UK, W_UV) instead of calling it, so an
unmerged adapter there is refused at decode (``MLA._derive``); :func:`merge_lora` merges it.

:func:`merge_lora` also re-derives every layer's absorbed weights. PEFT merges into the base
weight in place through ``.data``, which the version counter that decides when they are
re-derived does not see; without that, a layer whose absorbed weights were derived before the
adapter was merged (a ``generate`` before training) would decode with the weight from before.

peft is imported on first use: ``pip install 'qkmla[hf]'``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Union

from torch import nn

from ...attention.mla import projection_shapes
from ...config import check_positive_int
from ...norms import QKNorm
from ...utils.checked import as_int, as_number, check_bool, is_finite_number, is_number
from .patched import inner_model, latent_layers, model_settings

DEFAULT_TARGETS = ("q_b_proj", "kv_b_proj", "o_proj")
NORMS = ("q_norm", "k_norm", "q_a_layernorm", "kv_a_layernorm", "logit_scale")  # named in the error for a norm


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError(f"qkmla.integrations.transformers' LoRA helpers need peft: pip install 'qkmla[hf]' "
                          f"({e})") from e
    return peft


def lora_targets(config) -> tuple[str, ...]:
    """The attention projections of a layer with :class:`~qkmla.MLAConfig` ``config`` that LoRA
    can adapt: ``q_proj`` without a query latent (``q_lora_rank`` None), ``q_a_proj`` and
    ``q_b_proj`` with one, then ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``."""
    return tuple(name for name in projection_shapes(config) if not name.endswith("layernorm"))


def _check_separate_query(model, name: str) -> None:
    """A ValueError naming ``name`` for a model whose latent layers take their query from a fused
    query-and-gate projection (AXK2's q_gate_proj): the targets here name q_b_proj, which such a
    layer lacks, so its query would silently keep no adapter."""
    if any("q_gate_proj" in layer.projection_shapes(layer.config) for layer in latent_layers(model)):
        raise ValueError(f"{name}: its attention takes the query and an output gate from one fused q_gate_proj "
                         f"(AXK2), which qkmla's LoRA helpers do not adapt yet (the query would keep no adapter); "
                         f"the families whose query goes through q_b_proj or q_proj are supported")


def _check_targets(targets: Union[str, Iterable[str]], config) -> tuple[str, ...]:
    """``targets`` as a tuple of this config's projection names, in order, without repeats."""
    allowed = lora_targets(config)
    names = (targets,) if isinstance(targets, str) else targets
    try:
        names = tuple(dict.fromkeys(names))
    except TypeError:
        raise ValueError(f"targets: expected projection names such as {DEFAULT_TARGETS}, got "
                         f"{type(targets).__name__}") from None
    if not names:
        raise ValueError(f"targets: expected at least one of this model's attention projections {allowed}")
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"targets: expected projection names (str), got {name!r}")
        if name in allowed:
            continue
        if name in NORMS:
            raise ValueError(f"targets: {name!r} is a norm, not a projection; LoRA adapts this model's attention "
                             f"projections {allowed}. The QK norms (q_norm, k_norm), the latent norms "
                             f"(q_a_layernorm, kv_a_layernorm) and the logit scale are not LoRA targets; "
                             f"train_qk_norm=True trains the QK norms beside the adapters")
        why = ""
        if name in ("q_proj", "q_a_proj", "q_b_proj"):
            why = (f" (q_lora_rank={config.q_lora_rank}: the query goes through q_a_proj and q_b_proj, there is no "
                   f"q_proj)" if config.q_lora_rank is not None
                   else " (q_lora_rank=None: the query is one q_proj, there is no q_a_proj or q_b_proj)")
        raise ValueError(f"targets: {name!r} is not an attention projection of this model's layers{why}; expected "
                         f"some of {allowed}")
    return tuple(n for n in allowed if n in names)


def default_targets(config) -> tuple[str, ...]:
    """:data:`DEFAULT_TARGETS` for a layer with :class:`~qkmla.MLAConfig` ``config``: the query's up-projection
    (``q_proj`` without a query latent, ``q_lora_rank`` None: DeepSeek-V2-Lite, Kimi-Linear), ``kv_b_proj`` and
    ``o_proj``."""
    return DEFAULT_TARGETS if config.q_lora_rank is not None else ("q_proj",) + DEFAULT_TARGETS[1:]


def attention_lora_config(model, targets: Union[None, str, Iterable[str]] = None, r: int = 8,
                          lora_alpha: float = 16, lora_dropout: float = 0.0, train_qk_norm: bool = False, **kwargs):
    """A ``peft.LoraConfig`` whose adapters sit on ``targets`` in every attention layer of a
    patched model, and nowhere else.

    Args:
        model: a model ``apply_latent_attention`` patched (the ``*ForCausalLM`` or the inner ``*Model``).
        targets: attention projections by name, a subset of :func:`lora_targets` of its layers:
            ``q_a_proj``, ``q_b_proj`` (or ``q_proj`` for a model without ``q_lora_rank``),
            ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``; None: :func:`default_targets`.
        r, lora_alpha, lora_dropout: LoRA's rank, scale numerator and dropout (``peft.LoraConfig``).
        train_qk_norm: also train the QK-norm weights (``q_norm``, ``k_norm``; a norm
            ``apply_latent_attention(model, qk_norm=...)`` just added starts at ones), as PEFT's
            ``modules_to_save``. A learnable logit scale is a parameter of the attention layer
            itself, which PEFT cannot train beside adapters on its projections: it stays frozen.
        kwargs: other ``peft.LoraConfig`` fields (``target_modules`` is set from ``targets``).

    Returns:
        the ``peft.LoraConfig``; ``target_modules`` is a regular expression over the layers'
        module names, e.g. ``model\\.layers\\.\\d+\\.self_attn\\.(q_b_proj|kv_b_proj|o_proj)``.

    Raises:
        ValueError, before any work: a model not patched (naming ``model``), a target that is
        not one of its attention projections, or a norm (naming ``targets``),
        ``train_qk_norm`` on a model without a QK norm, ``target_modules`` passed.
    """
    model_settings(model)
    _check_separate_query(model, "model")
    # Checked here, before PEFT's own: LoraConfig(r=0) was accepted and failed only in get_peft_model, and a
    # NaN alpha or a dropout of 2.0 not at all (a NaN adapter scale; every activation dropped).
    # NumPy numbers are the numbers they hold (r=np.int64(8) was refused as "expected a positive int, got
    # np.int64(8)"), and PEFT gets Python ones (its config is written as JSON, which takes no NumPy scalar)
    r = as_int(r)
    lora_alpha, lora_dropout = as_number(lora_alpha), as_number(lora_dropout)
    check_positive_int("r", r)
    if not is_finite_number(lora_alpha) or lora_alpha <= 0:
        raise ValueError(f"lora_alpha: expected a finite number > 0 (the adapters' scale is lora_alpha / r), "
                         f"got {lora_alpha!r}")
    if not is_number(lora_dropout) or not 0 <= lora_dropout < 1:
        raise ValueError(f"lora_dropout: expected a probability in [0, 1), got {lora_dropout!r}")
    config = latent_layers(model)[0].config
    # None, not DEFAULT_TARGETS: a model without a query latent has q_proj, and its default was refused as
    # "targets: 'q_b_proj' is not an attention projection", an argument the caller never passed
    names = _check_targets(default_targets(config) if targets is None else targets, config)
    check_bool("train_qk_norm", train_qk_norm)
    if train_qk_norm and not config.has_qk_norm:
        raise ValueError("train_qk_norm: this model has no QK norm; add one with "
                         "apply_latent_attention(model, qk_norm='rms')")
    if "target_modules" in kwargs:
        raise ValueError("target_modules: attention_lora_config sets it from targets (attention projections by name)")
    peft = _peft()
    # A misspelt field (lora_dropuot=0.1) was PEFT's "LoraConfig.__init__() got an unexpected keyword argument
    # 'lora_dropuot'", which names it last; named first here, with what is taken
    unknown = sorted(set(kwargs) - {f.name for f in dataclasses.fields(peft.LoraConfig) if f.init})
    if unknown:
        raise TypeError(f"{unknown[0]}: not a field of peft.LoraConfig (peft {peft.__version__}); "
                        f"attention_lora_config takes targets, r, lora_alpha, lora_dropout, train_qk_norm and "
                        f"LoraConfig's other fields")
    if kwargs.get("lora_bias"):
        _check_lora_bias(latent_layers(model)[0], names, "lora_bias")
    layers = next(name for name, module in model.named_modules() if module is inner_model(model).layers)
    pattern = rf"{re.escape(layers)}\.\d+\.self_attn\.({'|'.join(names)})"
    latent = [name for name, module in model.named_modules() if any(module is a for a in latent_layers(model))]
    if len(latent) != len(inner_model(model).layers) or any(not n.endswith(".self_attn") for n in latent):
        # a hybrid's linear-attention layers (their projections keep no adapter) or LongCat-Flash's two
        # attention modules per layer: the MLA modules by name
        pattern = rf"({'|'.join(re.escape(n) for n in latent)})\.({'|'.join(names)})"
    if train_qk_norm:
        # PEFT saves a module whose name ends with an entry: each attention module's own, as its layer names it
        # (LongCat-Flash's two are self_attn.0 and self_attn.1, whose norms "self_attn.q_norm" matched none: its
        # norms stayed frozen without a word)
        within = dict.fromkeys(re.sub(rf"^{re.escape(layers)}\.\d+\.", "", n) for n in latent)
        norms = [f"{module}.{norm}" for module in within for norm in ("q_norm", "k_norm")]
        kwargs["modules_to_save"] = list(kwargs.get("modules_to_save") or []) + norms
    return peft.LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout, target_modules=pattern, **kwargs)


def _check_lora_bias(layer, names, prefix: str) -> None:
    """Refuse LoRA's own bias (``lora_bias=True``) on a projection without a bias: PEFT merges it into the
    base projection's bias, and without one refuses to merge ("Impossible to merge LoRA with `lora_bias=True`
    because the base layer has no bias", its RuntimeError from merge_lora), while the absorbed decode path,
    which reads kv_b_proj.weight alone, cannot run the unmerged adapter: a model trained so could never
    decode from the latent cache. kv_b_proj never has a bias (q_b_proj neither; attention_bias biases
    q_a_proj, kv_a_proj_with_mqa and o_proj)."""
    bare = [name for name in names if getattr(getattr(layer, name, None), "bias", None) is None]
    if bare:
        verb = "has" if len(bare) == 1 else "have"
        raise ValueError(f"{prefix}: LoRA's bias (lora_bias=True) is merged into the projection's own bias, and "
                         f"{', '.join(bare)} {verb} none (the absorbed decode path reads kv_b_proj.weight alone), so "
                         f"the adapters could not be merged for decoding; leave lora_bias out, or target only "
                         f"projections with a bias")


def _targets(config, name: str) -> bool:
    """Whether a LoRA config's target_modules (a regular expression or a list of names) names ``name``."""
    modules = config.target_modules
    return bool(re.search(rf"\b{name}\b", modules)) if isinstance(modules, str) else name in (modules or ())


def check_norms_have_a_place(base, peft_config: dict, argument: str = "peft_model",
                             active_only: bool = False) -> None:
    """Refuse adapters that trained the QK norm (``train_qk_norm``: the norms in ``modules_to_save``) over a
    model without one: PEFT loads such an adapter onto it without a word, dropping the trained norm weights
    it has nowhere to put, and the merged model (merge_lora) or the PEFT model itself (its forward, checked by
    ``apply_latent_attention``'s hook) then computed another function than the one fine-tuned. ``base``: the
    model under the adapters; ``peft_config``: their configs by adapter name. ``active_only`` (a forward): only
    the adapters PEFT applies now, none under ``disable_adapter()``: a loaded adapter not set active computes
    nothing, and refusing it refused every forward of the adapter that was."""
    entries = {name: [m for m in getattr(config, "modules_to_save", None) or [] if isinstance(m, str)
                      and m.split(".")[-1] in ("q_norm", "k_norm")] for name, config in peft_config.items()}
    if not any(entries.values()) or latent_layers(base)[0].config.has_qk_norm:
        return  # checked per forward: no module walk unless an adapter saves a norm
    if active_only:
        from peft.tuners.tuners_utils import BaseTunerLayer

        layer = next((m for m in base.modules() if isinstance(m, BaseTunerLayer)), None)
        if layer is not None:  # PEFT's layers all hold the active adapters and the disabled flag
            active = () if layer.disable_adapters else layer.active_adapters
            entries = {name: saved for name, saved in entries.items() if name in active}
    modules = [n for n, _ in base.named_modules()]
    for name, saved in entries.items():
        # The entries PEFT found no module for (it matches a module whose name ends with the entry): a sparse
        # model's own indexer.k_norm, saved beside the adapters, has its place and is kept
        norms = [m for m in saved if not any(n == m or n.endswith("." + m) for n in modules)]
        if norms:
            raise ValueError(f"{argument}: its adapter {name!r} trained the QK norm ({norms} in modules_to_save, "
                             f"train_qk_norm=True), but the model under it has none, so the trained norm weights were "
                             f"dropped; load the adapter onto the QK-normed model it was trained on "
                             f"(qkmla.integrations.transformers.from_pretrained of its checkpoint, or "
                             f"apply_latent_attention(model, qk_norm=...) with the same norm)")


def merge_lora(peft_model, **kwargs):
    """Merge a PEFT model's adapters into the patched model under it, ready for absorbed decode.

    Args:
        peft_model: ``peft.get_peft_model(model, attention_lora_config(model, ...))`` or any
            ``peft.PeftModel`` over a model ``apply_latent_attention`` patched.
        kwargs: passed to ``merge_and_unload`` (``safe_merge=``, ``adapter_names=``).

    Returns:
        the patched model, its attention projections plain ``nn.Linear`` and its QK norms
        qkmla's again, every layer's absorbed weights derived from the merged weights.

    Raises:
        ValueError: ``peft_model`` is not a PEFT model over a patched model, or its adapter trained a
            QK norm the model does not have (``train_qk_norm`` over a model without one: PEFT dropped the
            norm's weights), before any work; or a projection is still wrapped after merging (an adapter
            PEFT cannot merge).
    """
    peft = _peft()
    if not isinstance(peft_model, peft.PeftModel):
        raise ValueError(f"peft_model: expected a peft.PeftModel (peft.get_peft_model(model, "
                         f"attention_lora_config(model))), got {type(peft_model).__name__}")
    try:
        model_settings(peft_model.get_base_model())
    except ValueError as e:
        raise ValueError(f"peft_model: its base model is not one apply_latent_attention patched ({e})") from None
    _check_separate_query(peft_model.get_base_model(), "peft_model")
    check_norms_have_a_place(peft_model.get_base_model(), peft_model.peft_config)
    for name, config in peft_model.peft_config.items():
        if getattr(config, "lora_bias", False):
            layer = latent_layers(peft_model.get_base_model())[0]
            _check_lora_bias(layer, [t for t in lora_targets(layer.config) if _targets(config, t)],
                             f"peft_model: its adapter {name!r}")
    model = peft_model.merge_and_unload(**kwargs)
    for i, layer in enumerate(latent_layers(model)):
        for name in lora_targets(layer.config):
            module = getattr(layer, name)
            if not isinstance(module, nn.Linear):
                raise ValueError(f"peft_model: after merge_and_unload, layer {i}'s {name} is still a "
                                 f"{type(module).__name__}, not an nn.Linear; the absorbed path needs plain "
                                 f"projections")
        for name in ("q_norm", "k_norm"):
            module = getattr(layer, name)
            if module is not None and not isinstance(module, QKNorm):
                raise ValueError(f"peft_model: after merge_and_unload, layer {i}'s {name} is still a "
                                 f"{type(module).__name__}, not qkmla's QKNorm")
        layer.refresh_absorbed()
    return model


__all__ = ["DEFAULT_TARGETS", "attention_lora_config", "lora_targets", "merge_lora"]
