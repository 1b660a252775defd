"""qkmla's torchtitan overrides: activated with ``--override.imports`` (torchtitan >= 0.3), no fork.

    --override.imports qkmla.integrations.torchtitan.overrides.qk_norm
    --override.imports 'qkmla.integrations.torchtitan.overrides.qk_norm={"kind": "lp", "p": 3, "mode": "unified"}'
    --override.imports 'qkmla.integrations.torchtitan.overrides.qk_clip={"tau": 100}' \
                       qkmla.integrations.torchtitan.overrides.qk_clip_optimizer
    --override.imports qkmla.integrations.torchtitan.overrides.max_logits \
                       qkmla.integrations.torchtitan.overrides.max_logit_metrics

``qk_norm``      every language-model attention layer (``*.attention``) becomes :class:`QKAttention`
                 with qkmla's QK norm: ``kind`` "rms" (the paper's) / "l2" / "lp", ``mode``
                 "blockwise" (the paper's) / "unified" / "content", ``p``, ``eps``, ``scope``,
                 ``learnable_logit_scale`` (a :class:`~qkmla.QKNormConfig`'s fields), ``logit_scale_init``,
                 ``track_max_logits`` (for the metric);
``qk_clip``      the same layers with QK-Clip's threshold ``tau`` (100: Kimi K2's), measuring max logits;
``qk_clip_optimizer``  the optimizer container that clips after each step (both are needed).
``max_logits``   the layers, plain, measuring their max logits for the metric;
``max_logit_metrics``  the metrics processor that logs them (with any of the three above).

Each attention override refuses, naming itself, a layer that is not torchtitan's DeepSeek-V3
``Attention`` (a Llama or Qwen attention, or another override's MLA subclass such as
``fused_mla``), and torchtitan refuses two of them on one layer (its per-node conflict check):
QK-Clip with a QK norm is refused there, and again by :class:`QKAttention.Config`.
"""

from __future__ import annotations

from typing import Optional

from .versions import check_torchtitan

check_torchtitan()

from torchtitan.components.metrics import MetricsProcessor  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402
from torchtitan.config import derive, override  # noqa: E402
from torchtitan.models.common.attention import BaseAttention  # noqa: E402
from torchtitan.models.deepseek_v3.model import Attention  # noqa: E402

from ...config import QKNormConfig  # noqa: E402
from ...utils.checked import is_number  # noqa: E402
from .attention import QKAttention  # noqa: E402
from .clip import QKClipOptimizersContainer  # noqa: E402
from .metrics import MaxLogitMetricsProcessor  # noqa: E402

LAYERS = ["*.attention"]  # the language model's attention (Kimi K2.7's vision encoder names its own `attn`)


def _deepseek(cfg, override_name: str) -> None:
    """ValueError naming the override unless ``cfg`` is torchtitan's own DeepSeek-V3 attention config."""
    if type(cfg) is not Attention.Config:
        kind = type(cfg).__qualname__.removesuffix(".Config")
        raise ValueError(f"{override_name}: qkmla replaces torchtitan's DeepSeek-V3 MLA Attention (--module "
                         f"deepseek_v3 or kimi_k2_7), but this model's attention is {kind}"
                         + ("; another override already replaced it, activate one of the two"
                            if isinstance(cfg, Attention.Config) else ""))


@override(target=BaseAttention.Config, fqns=LAYERS,
          description="qkmla: post-up-projection QK norm on DeepSeek-V3 MLA (absorbable at decode)")
def qk_norm(cfg, *, kind: str = "rms", mode: str = "blockwise", p: float = 2.0, eps: float = 1e-6,
            scope: str = "head", learnable_logit_scale: bool = False,
            logit_scale_init: Optional[float] = None, track_max_logits: bool = False) -> QKAttention.Config:
    _deepseek(cfg, "qk_norm")
    try:
        norm = QKNormConfig(kind, mode, p, eps, scope, learnable_logit_scale)
    except ValueError as e:
        raise ValueError(f"qk_norm: {e}") from None
    if norm.kind is None:
        raise ValueError("qk_norm: kind: expected one of ('rms', 'l2', 'lp'); for a plain layer measuring its max "
                         "logits use the max_logits override")
    return derive(cfg, QKAttention.Config, qk_norm=norm, logit_scale_init=logit_scale_init,
                  track_max_logits=track_max_logits)


@override(target=BaseAttention.Config, fqns=LAYERS,
          description="qkmla: QK-Clip (MuonClip) thresholds on DeepSeek-V3 MLA; needs qk_clip_optimizer")
def qk_clip(cfg, *, tau: float = 100.0) -> QKAttention.Config:
    _deepseek(cfg, "qk_clip")
    if not is_number(tau) or not 0 < tau < float("inf"):
        raise ValueError(f"qk_clip: tau: expected a finite positive threshold (Kimi K2: 100), got {tau!r}")
    return derive(cfg, QKAttention.Config, qk_clip_tau=tau)


@override(target=BaseAttention.Config, fqns=LAYERS,
          description="qkmla: DeepSeek-V3 MLA measuring each head's max logit (for max_logit_metrics)")
def max_logits(cfg) -> QKAttention.Config:
    _deepseek(cfg, "max_logits")
    return derive(cfg, QKAttention.Config, track_max_logits=True)


@override(target=OptimizersContainer.Config, exact=True,
          description="qkmla: QK-Clip after each optimizer step")
def qk_clip_optimizer(cfg) -> QKClipOptimizersContainer.Config:
    return derive(cfg, QKClipOptimizersContainer.Config)


@override(target=MetricsProcessor.Config, exact=True,
          description="qkmla: each layer's max attention logit in the metrics")
def max_logit_metrics(cfg) -> MaxLogitMetricsProcessor.Config:
    return derive(cfg, MaxLogitMetricsProcessor.Config)
