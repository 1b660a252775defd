"""QK-Clip (MuonClip) for torchtitan: the paper's baseline, run after every optimizer step.

Each :class:`~.attention.QKAttention` with a threshold tau measures its heads' max logits S_h
during the step (``attention.py``); after the optimizer step, :func:`qk_clip_step` takes the max
over every rank (``close_steps``) and rescales the rows of the layer's up-projections so that every
logit of head h is multiplied by exactly gamma_h = min(1, tau / S_h), MLA-aware as Kimi K2 and
Megatron-Core apply it (qkmla's :func:`~qkmla.attention.qk_clip.mla_clip_row_factors`): the
content query rows (W_Q, or W_QB with a query LoRA) and the content key rows (W_KVB) by
sqrt(gamma_h), the RoPE query rows by gamma_h, the shared RoPE key and the values untouched.
The logits after the clip are then gamma_h S_h = min(S_h, tau) (kept as ``clipped_max_logits``
for the metric): the true post-clip max logit of the step's batch, to rounding.

Weights sharded by FSDP2 are scaled in place on each rank's own rows.

:class:`QKClipOptimizersContainer` is torchtitan's optimizer container with the clip as a step
post-hook (the ``qk_clip_optimizer`` override puts it in place).
"""

from __future__ import annotations

from dataclasses import dataclass

from .versions import check_torchtitan

check_torchtitan()

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.components.optimizer import OptimizersContainer  # noqa: E402

from ...attention.qk_clip import clip_factors, mla_clip_row_factors  # noqa: E402
from .attention import close_steps, qk_attention_layers  # noqa: E402


@torch.no_grad()
def scale_rows_(weight: torch.Tensor, factors: torch.Tensor) -> None:
    """weight[i, :] *= factors[i] in place, for a plain tensor or a DTensor (each rank scales the
    rows of its own shard). weight: [R, K]; factors: [R]."""
    if isinstance(weight, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        local = weight.to_local()
        if local.numel():
            local.mul_(factors[offset[0]:offset[0] + shape[0]].to(device=local.device, dtype=local.dtype)[:, None])
        return
    weight.mul_(factors.to(device=weight.device, dtype=weight.dtype)[:, None])


@torch.no_grad()
def qk_clip_step(model_parts) -> dict[str, torch.Tensor]:
    """QK-Clip on every clipping layer of ``model_parts`` after an optimizer step; returns
    {layer name: gamma [h]} (1 where a head was under tau). Call it on every rank at every step."""
    closed = close_steps(model_parts)
    gammas = {}
    for name, layer in qk_attention_layers(model_parts):
        if layer.qk_clip_tau is None or name not in closed:
            continue
        max_logit = closed[name]
        if not bool(torch.isfinite(max_logit).all()):  # tau / inf would zero the head's weights
            raise FloatingPointError(f"{name}: the step's max logit is {float(max_logit.max())} (a logit overflowed); "
                                     f"QK-Clip cannot rescale by tau / S, and training has diverged")
        gamma = clip_factors(max_logit, layer.qk_clip_tau)
        q_rows, kv_rows = mla_clip_row_factors(gamma, layer.n_heads, layer.qk_nope_head_dim, layer.qk_rope_head_dim,
                                               layer.v_head_dim)
        scale_rows_(layer.wq.weight if layer.q_lora_rank == 0 else layer.wq_b.weight, q_rows)
        scale_rows_(layer.wkv_b.weight, kv_rows)
        layer.clipped_max_logits = max_logit * gamma
        gammas[name] = gamma
    return gammas


class QKClipOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container, with :func:`qk_clip_step` after each step."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def __init__(self, config: Config, *, model_parts) -> None:
        super().__init__(config, model_parts=model_parts)
        if not any(layer.qk_clip_tau is not None for _, layer in qk_attention_layers(model_parts)):
            raise ValueError("optimizer: qkmla's qk_clip_optimizer override clips the layers that the qk_clip "
                             "override set up, and this model has none; activate both (or neither)")
        self.register_step_post_hook(lambda optimizer, args, kwargs: qk_clip_step(self.model_parts))
