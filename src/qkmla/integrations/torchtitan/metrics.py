"""The max attention logit per layer in torchtitan's metrics (console, TensorBoard, W&B alike).

:class:`MaxLogitMetricsProcessor` is torchtitan's ``MetricsProcessor`` (the ``max_logit_metrics``
override puts it in place) that adds, at each logged step, for every layer that measures its max
logits (``QKAttention`` with ``track_max_logits`` or a QK-Clip threshold):

    max_logit/layer_{i}               the largest pre-softmax logit over its heads, over every rank,
                                      since the step was last closed (by QK-Clip: this step;
                                      otherwise: since the last logged step)
    max_logit_after_clip/layer_{i}    with QK-Clip: the same after this step's clip, min(S, tau)
    max_logit                         the largest over the layers

for plain, QK-normed and clipped runs alike, so the three arms of the paper's comparison report
the same figure. The console gets one line per logged step beside torchtitan's own:

    max_logit step:  10  all: 41.2031  after clip: 30.0000  layers: 12.3906 41.2031 ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .versions import check_torchtitan

check_torchtitan()

from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402

from .attention import _layer_slot, close_steps, qk_attention_layers  # noqa: E402


def max_logit_metrics(model_parts) -> dict[str, float]:
    """The metrics above, closing the step of layers that QK-Clip has not closed (a collective:
    every rank calls it at the same steps)."""
    close_steps(model_parts)
    metrics = {}
    for name, layer in qk_attention_layers(model_parts):
        if not layer.track_max_logits or layer.step_max_logits is None:
            continue
        table, row = _layer_slot(name)
        label = f"{'mtp_layer' if table else 'layer'}_{row}"
        metrics[f"max_logit/{label}"] = float(layer.step_max_logits.max())
        if layer.clipped_max_logits is not None:
            metrics[f"max_logit_after_clip/{label}"] = float(layer.clipped_max_logits.max())
    if metrics:
        metrics["max_logit"] = max(v for k, v in metrics.items() if k.startswith("max_logit/"))
    return metrics


def console_line(step: int, metrics: dict[str, float]) -> str:
    """The step's max logits as one console line (module docstring)."""
    layers = " ".join(f"{v:.4f}" for k, v in metrics.items() if k.startswith("max_logit/"))
    after = [v for k, v in metrics.items() if k.startswith("max_logit_after_clip/")]
    clip = f"  after clip: {max(after):.4f}" if after else ""
    return f"max_logit step: {step:3d}  all: {metrics['max_logit']:.4f}{clip}  layers: {layers}"


class MaxLogitMetricsProcessor(MetricsProcessor):
    """torchtitan's metrics with each layer's max attention logit (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None):
        extra = dict(extra_metrics or {})
        if getattr(self, "model_parts", None):
            measured = max_logit_metrics(self.model_parts)
            extra.update(measured)
            if measured:
                logger.info(console_line(step, measured))
        return super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
