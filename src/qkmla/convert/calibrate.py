"""Calibrating a whole model's new QK norm on its own activations (:func:`warm_start_qk_norm`).

Adding a QK norm changes the model: nothing of it is exact. With the norm weights at ones each
logit becomes

    s = tau · ( qh^C · kh^C + RoPE(qh^R) · RoPE(kh^R) ),   each qh, kh = v · sigma(v)

instead of tau · (q^C · k^C + RoPE(q^R) · RoPE(k^R)): every score loses its query's and key's
magnitudes, so its size is set by d_n, d_r and the angle between them, not by the trained
norms. A trained checkpoint whose q and k are far from unit RMS then attends far too flatly or
far too sharply.

The calibration runs the model on a calibration batch of token ids, and as each layer is
reached (so that it sees the hidden states the calibrated layers before it produce) sets its
norm weights to constants per block b (content, RoPE): gamma_q^b and gamma_k^b each first bring
their side to the source layer's RMS on those hidden states, and then both are multiplied by
sqrt(c_b), with c_b chosen so that the RMS of the block's causal scores equals the source
layer's on the calibration batch. That equality holds exactly on the calibration batch; on
other text it holds approximately. What it cannot do is make the layer compute the source
function: what a norm removes, each token's and each head's magnitude, no weight shared by all
tokens and heads restores. So the logits match in scale, not in value, and a short fine-tune
recovers the rest (docs/interop.md shows it end to end).
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch

from ..attention.functional import per_head
from ..attention.mla import MLA

_BLOCKS = ("content", "rope")


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def block_scores(q: torch.Tensor, k: torch.Tensor, scale, heads_per_group: int) -> torch.Tensor:
    """Causal scores scale · q·k of one block: q [B, T, h, d], k [B, T, G, d] -> [n], one per
    visible (query, key) pair."""
    k = k.repeat_interleave(heads_per_group, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q.double(), k.double()) * per_head(scale, 2)
    T = q.shape[1]
    return s[..., torch.ones(T, T, dtype=torch.bool, device=q.device).tril()].flatten()


@contextlib.contextmanager
def without_norm(layers: list):
    """The layers compute their source function (no QK norm, the config's fixed logit scale)
    inside the block; their norms come back after it."""
    saved = [(layer.q_norm, layer.k_norm, layer.logit_scale) for layer in layers]
    try:
        for layer in layers:
            layer.q_norm = layer.k_norm = layer.logit_scale = None
        yield
    finally:
        for layer, (q_norm, k_norm, logit_scale) in zip(layers, saved):
            layer.q_norm, layer.k_norm, layer.logit_scale = q_norm, k_norm, logit_scale


def unit_weights(layer: MLA) -> None:
    """The layer's QK-norm weights at ones and its learnable logit scale (if any) at tau: the
    norm as a pure statistic, where calibration starts."""
    with torch.no_grad():
        for norm in (layer.q_norm, layer.k_norm):
            norm.content.weight.fill_(1.0)
            norm.rope.weight.fill_(1.0)
        if layer.logit_scale is not None:
            layer.logit_scale.fill_(layer.config.scale)


def _blocks(q: torch.Tensor, k: torch.Tensor, d_n: int) -> dict:
    return {"content": (q[..., :d_n], k[..., :d_n]), "rope": (q[..., d_n:], k[..., d_n:])}


def calibrate_layer(layer: MLA, x: torch.Tensor, positions: torch.Tensor) -> dict:
    """Set one QK-normed layer's norm weights from its inputs x [B, T, hidden_size] at
    ``positions`` [B, T] (see the module docstring). Returns, per block, the weights set
    (``gamma_q``, ``gamma_k``) and the RMS of the causal logits of the source layer
    (``rms_source``), of the norm at unit weights (``rms_unit_weights``), and calibrated
    (``rms_calibrated``)."""
    c, hpg = layer.config, layer.config.heads_per_group
    with torch.no_grad():
        unit_weights(layer)
        with without_norm([layer]):
            q_src, k_src, _ = layer.explicit_qkv(x, positions)
        q_new, k_new, _ = layer.explicit_qkv(x, positions)  # unit weights: the statistic alone
        report = {}
        source, unit = _blocks(q_src, k_src, c.qk_nope_head_dim), _blocks(q_new, k_new, c.qk_nope_head_dim)
        for name in _BLOCKS:
            (qs, ks), (qn, kn) = source[name], unit[name]
            m_q, m_k = _rms(qs) / _rms(qn), _rms(ks) / _rms(kn)
            rms_source = _rms(block_scores(qs, ks, c.scale, hpg))
            rms_unit = _rms(block_scores(qn, kn, c.scale, hpg))
            factor = rms_source / (m_q * m_k * rms_unit)
            gamma_q, gamma_k = m_q * math.sqrt(factor), m_k * math.sqrt(factor)
            # A model whose hidden states hold NaN or inf (or a block whose scores are all 0) calibrated to NaN
            # weights, written into the norms without a word, and reported as NaN
            if not (math.isfinite(gamma_q) and math.isfinite(gamma_k)):
                where = f"layer {layer.layer_idx}" if isinstance(getattr(layer, "layer_idx", None), int) else "a layer"
                raise ValueError(f"model: {where}'s {name} block calibrates to gamma_q={gamma_q:.3g}, "
                                 f"gamma_k={gamma_k:.3g} (source score RMS {rms_source:.3g}): its hidden states or "
                                 f"weights hold NaN or inf, or its scores are all 0; no norm weight was changed")
            getattr(layer.q_norm, name).weight.fill_(gamma_q)
            getattr(layer.k_norm, name).weight.fill_(gamma_k)
            report[name] = dict(gamma_q=gamma_q, gamma_k=gamma_k, rms_source=rms_source, rms_unit_weights=rms_unit)
        q_new, k_new, _ = layer.explicit_qkv(x, positions)
        for name, (qn, kn) in _blocks(q_new, k_new, c.qk_nope_head_dim).items():
            report[name]["rms_calibrated"] = _rms(block_scores(qn, kn, layer.scale, hpg))
    return report


def check_token_ids(name: str, ids, vocab_size: int, min_length: int = 2) -> torch.Tensor:
    """``ids`` if it is a [B, T] integer tensor of token ids below ``vocab_size`` with T >= min_length."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        got = f"a {ids.dtype} tensor" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name}: expected token ids, a [batch, length] integer tensor, got {got}")
    if ids.is_meta:  # their range is read below: "Tensor.item() cannot be called on meta tensors"
        raise ValueError(f"{name}: on the meta device (shapes only), so they hold no token ids; pass them on the cpu "
                         f"or the model's device")
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < min_length:
        raise ValueError(f"{name}: expected [batch, length] with length >= {min_length}, got shape {tuple(ids.shape)}")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name}: token ids must lie in [0, {vocab_size}) (the model's vocab_size), got ids from "
                         f"{low} to {high}")
    return ids.long()


def check_loaded(model) -> None:
    """A ValueError naming ``model`` when any of its weights is on the meta device (built there and never
    loaded, or offloaded): a conversion reads the weights' values, and failed deep in its arithmetic with
    "Tensor.item() cannot be called on meta tensors", naming nothing."""
    meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ValueError(f"model: its weight {meta} (and maybe others) is on the meta device (shapes only: built "
                         f"under torch.device('meta') or offloaded, never loaded); load the model's weights first")


def _loss(model, ids: torch.Tensor) -> float:
    ids = ids.to(model.device)
    return float(model(input_ids=ids, labels=ids, use_cache=False).loss)


def warm_start_qk_norm(model, input_ids: torch.Tensor, *, held_out_ids: Optional[torch.Tensor] = None) -> dict:
    """Calibrate every layer's QK-norm weights on the model's own hidden states, in place.

    Args:
        model: a transformers DeepSeek model patched with a QK norm
            (``apply_latent_attention(model, qk_norm="rms")``); its norm weights are overwritten.
        input_ids: the calibration batch, [B, T] token ids (no padding).
        held_out_ids: other text, [B', T'] token ids, on which the model's next-token loss is
            measured: of the source model (the norm taken out), with the norm at unit weights,
            and calibrated. None skips the losses.

    Returns:
        {"layers": {i: {"content": {...}, "rope": {...}}} (each :func:`calibrate_layer`'s report),
        "loss": {"source", "unit_weights", "calibrated"} or None, "tokens": the calibration
        tokens}.

    Raises:
        ValueError, before any work: a model without a QK norm, token ids that are not a
        [batch, length] integer tensor within the model's vocabulary.
    """
    from ..integrations.transformers.patched import inner_model, latent_layers

    layers = latent_layers(model)
    check_loaded(model)
    if any(layer.q_norm is None for layer in layers):
        raise ValueError("model: has no QK norm to calibrate; add one with "
                         "qkmla.integrations.transformers.apply_latent_attention(model, qk_norm='rms')")
    vocab = model.config.vocab_size
    input_ids = check_token_ids("input_ids", input_ids, vocab)
    if held_out_ids is not None:
        held_out_ids = check_token_ids("held_out_ids", held_out_ids, vocab)
    was_training = model.training
    model.eval()
    loss = {}
    reports: dict[int, dict] = {}
    # The norms' weights as they came, put back if the calibration fails: a layer refused half way (NaN hidden
    # states) had left the layers before it calibrated, and every layer at unit weights when held_out_ids was given
    saved = [(t, t.detach().clone()) for layer in layers for t in (
        layer.q_norm.content.weight, layer.q_norm.rope.weight, layer.k_norm.content.weight, layer.k_norm.rope.weight,
        layer.logit_scale) if t is not None]

    def calibrate(module, args, kwargs):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        positions = kwargs.get("position_ids")
        positions = (positions if positions is not None else torch.arange(x.shape[1], device=x.device))
        reports[module.layer_idx] = calibrate_layer(module, x, positions.expand(*x.shape[:2]).to(x.device))

    try:
        with torch.no_grad():
            if held_out_ids is not None:
                with without_norm(layers):
                    loss["source"] = _loss(model, held_out_ids)
                for layer in layers:
                    unit_weights(layer)
                loss["unit_weights"] = _loss(model, held_out_ids)
            hooks = [layer.register_forward_pre_hook(calibrate, with_kwargs=True) for layer in layers]
            try:  # one forward: each layer is calibrated on what the calibrated layers before it give
                inner_model(model)(input_ids=input_ids.to(model.device), use_cache=False)
            finally:
                for hook in hooks:
                    hook.remove()
            if held_out_ids is not None:
                loss["calibrated"] = _loss(model, held_out_ids)
    except BaseException:
        with torch.no_grad():
            for t, value in saved:
                t.copy_(value)
        raise
    finally:
        model.train(was_training)
    return {"layers": dict(sorted(reports.items())), "loss": loss or None, "tokens": input_ids.numel()}
