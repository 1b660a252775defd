"""Arguments of ``qkmla train`` (also ``torchrun -m qkmla.train``), mapped onto TrainConfig."""

from __future__ import annotations

import argparse
import dataclasses

from ..model.gpt import ATTENTION_VARIANTS, GPT_PRESETS
from .optim import MUON_ADJUST, OPTIMIZERS, SCHEDULES
from .trainer import TrainConfig


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--preset", default=d.preset, choices=sorted(GPT_PRESETS))
    p.add_argument("--attn", default=d.attn, choices=ATTENTION_VARIANTS)
    p.add_argument("--qk-norm-p", type=float, default=None, help="p of the -lp variants (>= 1)")
    p.add_argument("--learnable-logit-scale", action="store_const", const=True, default=None,
                   help="learn one logit scale per head (always on for -l2/-lp; lifts the temperature cap of RMS QK norm)")
    p.add_argument("--softmax-scale", type=float, default=None, metavar="TAU",
                   help="logit scale tau (initial value when learned); default (d_n + d_r)^-1/2, sqrt(d) for -l2/-lp")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZERS)
    p.add_argument("--muon-adjust-lr", default=d.muon_adjust_lr, choices=MUON_ADJUST)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--schedule", default=d.schedule, choices=SCHEDULES)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="0 disables clipping")
    p.add_argument("--qk-clip", type=float, default=None, metavar="TAU", help="QK-Clip threshold (Kimi K2: 100)")
    p.add_argument("--qk-clip-alpha", type=float, default=d.qk_clip_alpha)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (split over ranks)")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--eval-interval", type=int, default=d.eval_interval)
    p.add_argument("--eval-iters", type=int, default=d.eval_iters)
    p.add_argument("--ckpt-interval", type=int, default=d.ckpt_interval)
    p.add_argument("--log-heads", action="store_true", help="also log every head's max logit")
    p.add_argument("--data", default=d.data, help="tiny_shakespeare, shakespeare, or a text file")
    p.add_argument("--tokenizer", default=d.tokenizer, choices=("char", "byte"))
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.safetensors")
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP under torchrun")


def train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    for name in ("steps", "batch_size", "eval_interval", "eval_iters", "ckpt_interval"):
        if getattr(args, name) < 1:
            raise SystemExit(f"qkmla train: --{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.qk_norm_p is not None and args.qk_norm_p < 1:
        raise SystemExit(f"qkmla train: --qk-norm-p: expected p >= 1, got {args.qk_norm_p}")
    if args.softmax_scale is not None and not args.softmax_scale > 0:
        raise SystemExit(f"qkmla train: --softmax-scale: expected a positive number, got {args.softmax_scale}")
    # Every option's dest is the TrainConfig field of the same name; only --no-progress is inverted.
    names = {f.name for f in dataclasses.fields(TrainConfig)} & set(vars(args))
    return TrainConfig(**{n: getattr(args, n) for n in names}, progress=not args.no_progress)
