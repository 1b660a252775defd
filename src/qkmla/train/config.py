"""The configuration of a training run, every field checked before any work starts.

Fields that may change when a run is resumed (``RESUMABLE``): the length and shape of the
schedule and what is logged (``steps``, ``lr``, ``schedule``, ``warmup_steps``,
``min_lr_ratio``, ``weight_decay``, ``grad_clip``, ``qk_clip``, ``qk_clip_alpha``,
``batch_size``, ``eval_interval``, ``eval_iters``, ``ckpt_interval``, ``log_heads``,
``max_seconds``, ``progress``, ``seed``: the data order comes from the checkpoint's RNG
state). Every other field defines the model or the data and must match the stored run.

A field set after construction (``config.grad_clip = -1.0``) is checked again with every other
(:func:`~qkmla.utils.checked.revalidated`), so a config is never one the constructor refuses.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from ..config import SOFTMAX_SCALE_RANGE, check_softmax_scale
from ..model.gpt import ATTENTION_VARIANTS, GPT_PRESETS, GPTConfig
from ..utils.checked import check_bool, check_seed, is_finite_number, is_int, python_numbers, revalidated
from .data import SPLITS, TOKENIZERS
from .optim import MUON_ADJUST, OPTIMIZERS, SCHEDULES

RESUMABLE = ("steps", "lr", "schedule", "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip", "qk_clip",
             "qk_clip_alpha", "batch_size", "eval_interval", "eval_iters", "ckpt_interval", "log_heads",
             "max_seconds", "progress", "seed", "out", "resume", "overwrite", "dist_timeout")
QK_CLIP_ATTN = ("mla", "mha", "gqa", "mqa")
DEFAULT_WARMUP_STEPS = 20


def _number(name: str, value, low: float, high: float = math.inf, low_open: bool = False,
            integer: bool = False, allow_none: bool = False) -> None:
    """value in [low, high] (or (low, high] with low_open), finite unless high is inf."""
    if value is None and allow_none:
        return
    kinds = (int,) if integer else (int, float)
    # an int is compared as an int: math.isnan(10**400) raised a bare OverflowError (utils.checked.is_finite_number)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and (integer or is_finite_number(value))
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if ok and integer and value >= 2**63:  # a count past int64 (--steps 10**20 trained on as if endless)
        raise ValueError(f"{name}: expected an int below 2**63 (counts are int64), got {value}")
    if not ok:
        what = "an int" if integer else "a finite number"
        # Integer bounds print whole: 2**63 - 1 as %g reads 9.22337e+18, a number nobody can type back.
        bound = (lambda x: f"{int(x)}") if integer else (lambda x: f"{x:g}")
        rng = f"{'>' if low_open else '>='} {bound(low)}" + (f" and <= {bound(high)}" if math.isfinite(high) else "")
        raise ValueError(f"{name}: expected {what} {rng}{' or None' if allow_none else ''}, got {value!r}")


def weight_decay_past_lr(decay_name: str, lr_name: str, weight_decay: float, lr: float) -> str:
    """The refusal of a weight decay whose product with the lr is 1 or more (named as the caller names them:
    TrainConfig's fields, or ``qkmla train``'s options)."""
    return (f"{decay_name}: times {lr_name} must be below 1 (decoupled weight decay multiplies the decayed weights "
            f"by 1 - {lr_name} * {decay_name} each step: 0 zeroes them, below 0 flips their sign), got {decay_name} "
            f"{weight_decay:g} with {lr_name} {lr:g} (1 - {lr * weight_decay:g} = {1 - lr * weight_decay:g}); lower "
            f"{lr_name} or {decay_name}")


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {list(allowed)}, got {value!r}")


@revalidated
@dataclass
class TrainConfig:
    preset: str = "debug"
    attn: str = "mla-qknorm"
    qk_norm_p: Optional[float] = None
    learnable_logit_scale: Optional[bool] = None  # None: the variant's default (see GPTConfig)
    softmax_scale: Optional[float] = None
    steps: int = 200
    batch_size: int = 12
    block_size: Optional[int] = None
    lr: float = 1e-3
    optimizer: str = "adamw"
    muon_adjust_lr: str = "match_rms_adamw"
    weight_decay: float = 0.1
    schedule: str = "cosine"
    warmup_steps: Optional[int] = None  # None: 20, or the whole run if it is shorter (warmup_for)
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    qk_clip: Optional[float] = None
    qk_clip_alpha: float = 0.5
    eval_interval: int = 50
    eval_iters: int = 10
    ckpt_interval: int = 100
    log_heads: bool = False
    data: str = "tiny_shakespeare"
    tokenizer: str = "char"
    split: str = "tail"  # "tail": the last 10% validates; "plays": held-out plays (shakespeare only)
    seed: int = 1337
    out: Optional[str] = None  # None: a fresh directory runs/<preset>-<attn>-<time>, printed at start
    resume: bool = False
    overwrite: bool = False  # replace a run already in ``out`` (without it, such a run is refused)
    max_seconds: Optional[float] = None
    progress: bool = True
    fsdp: bool = False
    dist_timeout: float = 600.0  # seconds a collective may wait for a rank under torchrun
    model_overrides: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        python_numbers(self)  # np.int64(2) is the int 2 (utils.checked)
        _choice("preset", self.preset, sorted(GPT_PRESETS))
        _choice("attn", self.attn, ATTENTION_VARIANTS)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("muon_adjust_lr", self.muon_adjust_lr, MUON_ADJUST)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("tokenizer", self.tokenizer, TOKENIZERS)
        _choice("split", self.split, SPLITS)
        if self.split == "plays" and self.data != "shakespeare":
            raise ValueError(f"split: 'plays' holds out whole plays of the embedded 'shakespeare' corpus, "
                             f"got data={self.data!r}")
        for name in ("steps", "batch_size", "eval_interval", "eval_iters", "ckpt_interval"):
            _number(name, getattr(self, name), 1, integer=True)
        _number("block_size", self.block_size, 2, integer=True, allow_none=True)
        _number("warmup_steps", self.warmup_steps, 0, integer=True, allow_none=True)
        if self.warmup_steps is not None and self.warmup_steps > self.steps:
            # A warmup longer than the run never reaches the peak lr: the whole run at a fraction of it.
            raise ValueError(f"warmup_steps: expected an int from 0 to the run's steps ({self.steps}; a longer warmup "
                             f"never reaches the peak lr), or None (the default: {DEFAULT_WARMUP_STEPS}, capped at the "
                             f"steps); got {self.warmup_steps}")
        if not (self.resume and is_int(self.seed) and 0 <= self.seed < 2 ** 63):
            # A resume reads no seed (the weights and the RNG state are the checkpoint's): a run an earlier qkmla
            # trained with a seed past 2**32 - 1 (taken then, up to 2**63 - 1) resumes, as it could before
            check_seed("seed", self.seed)
        _number("lr", self.lr, 0, low_open=True)
        _number("weight_decay", self.weight_decay, 0)
        _number("min_lr_ratio", self.min_lr_ratio, 0, 1)
        _number("grad_clip", self.grad_clip, 0)
        _number("qk_clip", self.qk_clip, 0, low_open=True, allow_none=True)
        low, high = SOFTMAX_SCALE_RANGE
        if self.qk_clip is not None and not low <= self.qk_clip <= high:
            # The heads' max logits are float32, and tau / S_h with them: tau = 1e-300 was 0 there, zeroed the
            # clipped heads' query and key rows, and the run diverged at step 1, blamed on --lr
            raise ValueError(f"qk_clip: expected a threshold within float32's normal range ({low!r} to {high!r}) or "
                             f"None, got {self.qk_clip!r}")
        _number("qk_clip_alpha", self.qk_clip_alpha, 0, 1)
        if self.lr * self.weight_decay >= 1:
            # decoupled weight decay multiplies every decayed weight by 1 - lr * weight_decay each step: at 1 it
            # zeroes them, past 1 it flips their sign (lr 10, weight decay 0.5: x -4 a step), without a word
            raise ValueError(weight_decay_past_lr("weight_decay", "lr", self.weight_decay, self.lr))
        _number("qk_norm_p", self.qk_norm_p, 1, allow_none=True)
        # The model holds tau in float32: --softmax-scale 1e300 became inf there and 1e-320 zero, and the first
        # forward's loss was NaN, blamed on --lr (probe 19). float32's normal range is the allowed one.
        check_softmax_scale(self.softmax_scale)  # the model configs' own check
        _number("max_seconds", self.max_seconds, 0, allow_none=True)
        _number("dist_timeout", self.dist_timeout, 0, low_open=True)
        if self.out is not None and (not isinstance(self.out, str) or not self.out.strip()):
            raise ValueError(f"out: expected a directory path or None (a fresh one), got {self.out!r}")
        if self.qk_norm_p is not None and not self.attn.endswith("-lp"):
            raise ValueError(f"qk_norm_p: only the -lp variants use p, got attn={self.attn!r}")
        if self.learnable_logit_scale not in (None, True, False):
            raise ValueError(f"learnable_logit_scale: expected True, False or None, got {self.learnable_logit_scale!r}")
        if self.qk_clip is not None and self.attn not in QK_CLIP_ATTN:
            raise ValueError(f"qk_clip: applies to attention without QK norm {QK_CLIP_ATTN} (a norm would undo "
                             f"the rescaling), got attn={self.attn!r}")
        # A switch given as a string is truthy: overwrite="no" replaced the run already in out, resume="no"
        # resumed it (config files and scripts spell switches as strings).
        for name in ("resume", "overwrite", "log_heads", "progress", "fsdp"):
            check_bool(name, getattr(self, name))
        if self.resume and self.overwrite:
            raise ValueError("overwrite: cannot be combined with resume (one continues the run, the other replaces it)")
        if self.resume and self.out is None:  # None means a fresh directory, which holds nothing to resume
            raise ValueError("out: resume continues the run in a directory; name it (--out DIR)")
        self.model_config(65)  # the model's own checks (e.g. n_head vs block size), before any work

    @property
    def warmup_for(self) -> int:
        """The warmup steps the schedule takes: ``warmup_steps``, or by default 20 capped at ``steps``."""
        return min(DEFAULT_WARMUP_STEPS, self.steps) if self.warmup_steps is None else self.warmup_steps

    def model_config(self, vocab_size: int) -> GPTConfig:
        changes = dict(self.model_overrides, attn=self.attn, vocab_size=vocab_size)
        if self.block_size is not None:
            changes["block_size"] = self.block_size
        for name in ("qk_norm_p", "learnable_logit_scale", "softmax_scale"):
            if getattr(self, name) is not None:
                changes[name] = getattr(self, name)
        return GPT_PRESETS[self.preset].replace(**changes)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)
