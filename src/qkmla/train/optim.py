"""Optimizers and learning-rate schedules.

* ``adamw``: AdamW; weight decay on matrices only, none on norms and logit scales.
* ``muon``: ``torch.optim.Muon`` for the hidden 2-D matrices (every nn.Linear inside the
  blocks) and AdamW for the embedding, the head, norms and logit scales, as Muon's authors
  prescribe. Muon's learning-rate adjustment (``adjust_lr_fn``: "original" scales by
  sqrt(max(1, rows / cols)), "match_rms_adamw" by 0.2 sqrt(max(rows, cols)) so AdamW's lr
  and weight decay carry over) is exposed as ``muon_adjust_lr``.

Schedules return a multiplier of the peak lr: linear warmup, then constant, cosine to
``min_lr_ratio``, or WSD (warmup-stable-decay; the decay is linear or 1 - sqrt, over the
last ``decay_fraction`` of the steps).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterable

import torch
from torch import nn

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("constant", "cosine", "wsd")
MUON_ADJUST = ("original", "match_rms_adamw")


class Optimizers:
    """Several optimizers stepped together, with one state dict (for checkpoints)."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)

    @property
    def param_groups(self):
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {str(i): opt.state_dict() for i, opt in enumerate(self.optimizers)}

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's moments and step counts, under the settings these optimizers were built
        with (:meth:`settings_kept`)."""
        with self.settings_kept():
            for i, opt in enumerate(self.optimizers):
                opt.load_state_dict(state[str(i)])

    @contextmanager
    def settings_kept(self):
        """Around a load of a checkpoint's state (torch's own, or FSDP's set_optimizer_state_dict):
        torch copies the saved param groups' settings (lr, initial_lr, weight_decay) over the ones
        built from the config, so a resume with another --lr or --weight-decay (settings a resume may
        change: train.config.RESUMABLE) trained at the old ones while config.json recorded the new.
        The groups' settings are put back; only the state (moments, steps) comes from the checkpoint."""
        settings = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        yield
        for group, kept in zip(self.param_groups, settings):
            group.update(kept)


def _is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    return p.dim() == 2 and name.startswith("blocks.")


def build_optimizer(model: nn.Module, name: str = "adamw", lr: float = 1e-3, weight_decay: float = 0.1,
                    betas=(0.9, 0.95), muon_lr: float | None = None, muon_adjust_lr: str = "match_rms_adamw") -> Optimizers:
    """The optimizer(s) for ``model``; every param group keeps ``initial_lr`` for schedules."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer: expected one of {OPTIMIZERS}, got {name!r}")
    if not lr > 0:
        raise ValueError(f"lr: expected a positive number, got {lr!r}")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in named if p.dim() >= 2]
    vectors = [p for n, p in named if p.dim() < 2]
    if name == "adamw":
        groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}]
        opts = [torch.optim.AdamW(groups, lr=lr, betas=betas)]
    else:
        if not hasattr(torch.optim, "Muon"):
            raise ValueError(f"optimizer: 'muon' needs torch.optim.Muon (PyTorch >= 2.9), this is {torch.__version__}")
        if muon_adjust_lr not in MUON_ADJUST:
            raise ValueError(f"muon_adjust_lr: expected one of {MUON_ADJUST}, got {muon_adjust_lr!r}")
        hidden = [p for n, p in named if _is_hidden_matrix(n, p)]
        hidden_ids = {id(p) for p in hidden}
        rest_matrices = [p for p in matrices if id(p) not in hidden_ids]
        muon = torch.optim.Muon(hidden, lr=muon_lr or lr, weight_decay=weight_decay, adjust_lr_fn=muon_adjust_lr)
        adam = torch.optim.AdamW([{"params": rest_matrices, "weight_decay": weight_decay},
                                  {"params": vectors, "weight_decay": 0.0}], lr=lr, betas=betas)
        opts = [muon, adam]
    for opt in opts:
        for g in opt.param_groups:
            g["initial_lr"] = g["lr"]
    return Optimizers(opts)


WSD_DECAY_FRACTION = 0.2  # the share of the steps, at the end, over which wsd decays


def lr_multiplier(step: int, total_steps: int, schedule: str = "cosine", warmup_steps: int = 0,
                  min_lr_ratio: float = 0.1, decay_fraction: float = WSD_DECAY_FRACTION,
                  decay_shape: str = "sqrt") -> float:
    """Multiplier of the peak lr at ``step`` (0-based). A decay after the warmup reaches
    ``min_lr_ratio`` at ``step == total_steps``, one past the last step trained, so the last step's
    multiplier is one decay step above it: for a decay of d steps, cosine's is (1 - min_lr_ratio)
    (1 + cos(pi (d - 1) / d)) / 2 above it, half the span at d = 2 (the committed experiments were run
    with this schedule)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: expected one of {SCHEDULES}, got {schedule!r}")
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = int(total_steps * (1 - decay_fraction))
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
    fall = math.sqrt(progress) if decay_shape == "sqrt" else progress
    return min_lr_ratio + (1 - min_lr_ratio) * (1 - fall)


def set_lr(optimizer: Optimizers, multiplier: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = g["initial_lr"] * multiplier
