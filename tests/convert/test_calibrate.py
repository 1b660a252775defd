"""Calibrating a whole model's QK norm on its own hidden states (``warm_start_qk_norm``)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla import QKNormConfig  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402
from qkmla.convert import warm_start_qk_norm  # noqa: E402
from qkmla.convert.calibrate import block_scores, without_norm  # noqa: E402

from tests.integrations.transformers.test_model import VOCAB, hf_model, patched  # noqa: E402


def batch(seed: int, rows: int = 4, length: int = 48) -> torch.Tensor:
    return torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def layer_inputs(model, ids) -> dict:
    """{layer: the hidden states its attention sees} in one uncached forward."""
    seen = {}
    hooks = [layer.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: seen.__setitem__(i, kwargs["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(latent_layers(model))]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


def logit_rms(layer, x, block: str) -> float:
    """RMS of one block's causal logits of ``layer`` on x."""
    c = layer.config
    with torch.no_grad():
        q, k, _ = layer.explicit_qkv(x, torch.arange(x.shape[1]).expand(x.shape[0], -1))
    cols = slice(0, c.qk_nope_head_dim) if block == "content" else slice(c.qk_nope_head_dim, None)
    return float(block_scores(q[..., cols], k[..., cols], layer.scale, c.heads_per_group).pow(2).mean().sqrt())


@pytest.mark.parametrize("norm", [dict(qk_norm="rms"), dict(qk_norm=QKNormConfig("rms", mode="unified")),
                                  dict(qk_norm="l2"),
                                  dict(qk_norm=QKNormConfig("lp", p=3.0, learnable_logit_scale=True))])
def test_each_layer_matches_the_source_logit_scale_on_what_the_calibrated_layers_before_it_give(norm):
    """Exact on the calibration batch: every block's logit RMS equals the source layer's on the
    hidden states of the calibrated model (so layer i was calibrated after layers < i were)."""
    source = hf_model("v3")
    model = patched(source, **norm)
    cal = batch(0)
    report = warm_start_qk_norm(model, cal)
    assert list(report["layers"]) == [0, 1, 2] and report["loss"] is None and report["tokens"] == cal.numel()
    inputs = layer_inputs(model, cal)
    for i, layer in enumerate(latent_layers(model)):
        for block in ("content", "rope"):
            r = report["layers"][i][block]
            with without_norm([layer]):
                assert logit_rms(layer, inputs[i], block) == pytest.approx(r["rms_source"], rel=1e-10)
            assert logit_rms(layer, inputs[i], block) == pytest.approx(r["rms_source"], rel=1e-10)
            assert r["rms_calibrated"] == pytest.approx(r["rms_source"], rel=1e-10)
            assert r["gamma_q"] != 1.0 and r["gamma_k"] != 1.0
            assert torch.all(getattr(layer.q_norm, block).weight == r["gamma_q"])
            assert torch.all(getattr(layer.k_norm, block).weight == r["gamma_k"])
    assert not model.training  # eval, as it was


def test_on_held_out_text_the_scale_holds_approximately_and_the_losses_are_reported():
    source = hf_model("v3")
    model = patched(source, qk_norm="rms")
    model.train()
    held = batch(1)
    report = warm_start_qk_norm(model, batch(0), held_out_ids=held)
    assert model.training  # restored
    with torch.no_grad():
        assert report["loss"]["source"] == pytest.approx(float(source(input_ids=held, labels=held).loss), rel=1e-12)
    assert set(report["loss"]) == {"source", "unit_weights", "calibrated"}
    model.eval()
    inputs = layer_inputs(model, held)
    for i, layer in enumerate(latent_layers(model)):
        for block in ("content", "rope"):
            calibrated = logit_rms(layer, inputs[i], block)
            with without_norm([layer]):
                want = logit_rms(layer, inputs[i], block)
            unit = report["layers"][i][block]["rms_unit_weights"] / report["layers"][i][block]["rms_source"]
            # measured 0.98-1.18 here, against 6-10x with the weights at ones
            assert 0.75 < calibrated / want < 1.33 and not 0.5 < unit < 2, (i, block, calibrated / want, unit)
    assert all(layer.q_norm is not None for layer in latent_layers(model))  # the norms came back


def test_bad_input_is_refused_before_any_work():
    model = patched(hf_model("v3"), qk_norm="rms")
    weights = {n: p.clone() for n, p in model.named_parameters()}
    cases = [
        (dict(input_ids=batch(0).float()), r"input_ids: expected token ids, a \[batch, length\] integer tensor, got a "
                                           r"torch.float32 tensor"),
        (dict(input_ids=[[1, 2, 3]]), "input_ids: expected token ids.* got list"),
        (dict(input_ids=batch(0)[0]), r"input_ids: expected \[batch, length\] with length >= 2, got shape \(48,\)"),
        (dict(input_ids=batch(0) + VOCAB), rf"input_ids: token ids must lie in \[0, {VOCAB}\) \(the model's "
                                           rf"vocab_size\), got ids from {VOCAB + 1} to"),
        (dict(input_ids=batch(0), held_out_ids=-batch(1)), r"held_out_ids: token ids must lie in \[0, 97\)"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            warm_start_qk_norm(model, **kwargs)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="model: has no QK norm to calibrate; add one with"):
        warm_start_qk_norm(patched(hf_model("v3")), batch(0))
    with pytest.raises(ValueError, match="model: its attention is transformers' own"):
        warm_start_qk_norm(hf_model("v3"), batch(0))
