"""Part 5 (with the time that is left): QK-norm against QK-Clip at the ``paper-400m`` shape.

Three variants, as in ``qkmla experiment qknorm-vs-clip``: plain MLA, MLA with QK-Clip at
tau = 100 (Kimi K2; ``qkmla.attention.qk_clip.qk_clip_`` after every step) and QK-normed MLA;
each at two learning rates, Muon for the hidden matrices (1e-2 and 2e-2: inside every
variant's first bracket in that experiment, which centres on the small-scale lr-sweep's best
Muon rates). On a step that clipped, the max logit the clipped weights produce on the same
batch is measured (``qkmla.train.diagnostics.forward_max_logits``), as the trainer does.
The embedded tiny Shakespeare text, character tokens, batch 12 x 1024, bf16 autocast, one
seed, the same initial weights' seed and the same batches for every run. The horizon is not known in
advance, so the learning rate is constant after a 20-step warm-up. The runs take steps in
turn until the time is up, so every run has the same number of steps; then each is
evaluated on the same validation windows.

This is a short comparison at one seed, not a result: the best learning rate of each
variant is only the better of two at the horizon reached.
"""

from __future__ import annotations

import math
import time

import torch

from .suite import PartContext, fmt, table

REAL = dict(preset="paper-400m", batch=12, lrs=(0.01, 0.02), warmup=20, eval_iters=10, max_steps=100000, tau=100.0)
# The dry run clips at a tau its tiny model's logits reach, so the clip and its measurement run.
DRY = dict(preset="debug", batch=2, lrs=(0.01,), warmup=1, eval_iters=1, max_steps=2, tau=0.05)


def variants(tau: float) -> dict:
    """name -> TrainConfig fields."""
    return {"mla": {"attn": "mla"}, f"mla-qkclip-{tau:g}": {"attn": "mla", "qk_clip": tau},
            "mla-qknorm": {"attn": "mla-qknorm"}}
OPTIMIZER = "muon"
CURVE_EVERY = 10


class Run:
    def __init__(self, ctx: PartContext, variant: str, lr: float, cfg: dict, vocab: int):
        from qkmla.model.gpt import GPT
        from qkmla.train.config import TrainConfig
        from qkmla.train.optim import build_optimizer

        self.ctx, self.variant, self.lr = ctx, variant, lr
        self.train_config = TrainConfig(preset=cfg["preset"], optimizer=OPTIMIZER, lr=lr, batch_size=cfg["batch"],
                                        warmup_steps=cfg["warmup"], schedule="constant",
                                        **variants(cfg["tau"])[variant])
        torch.manual_seed(self.train_config.seed)
        with torch.device(ctx.device):  # initialized where it trains
            self.model = GPT(self.train_config.model_config(vocab))
        self.opt = build_optimizer(self.model, OPTIMIZER, lr, self.train_config.weight_decay)
        self.attns = [b.attn for b in self.model.blocks]
        for a in self.attns:
            a.track_max_logits = True
        self.generator = torch.Generator().manual_seed(self.train_config.seed)  # the same batches for every run
        self.losses, self.max_logits, self.after_clip, self.error = [], [], [], None

    def step(self, corpus) -> None:
        from qkmla.attention.qk_clip import qk_clip_
        from qkmla.train.data import get_batch
        from qkmla.train.diagnostics import forward_max_logits
        from qkmla.train.optim import lr_multiplier, set_lr

        c = self.train_config
        i = len(self.losses)
        set_lr(self.opt, lr_multiplier(i, c.steps, c.schedule, c.warmup_steps))
        x, y = (t.to(self.ctx.device) for t in get_batch(corpus.train, c.batch_size, self.model.config.block_size,
                                                         self.generator))
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16):
            _, loss = self.model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        heads = torch.stack([a.last_max_logits.float() for a in self.attns])  # [layers, h]
        if c.qk_clip is not None:
            gammas = torch.stack([qk_clip_(a, m, c.qk_clip, c.qk_clip_alpha) for a, m in zip(self.attns, heads)])
            if bool((gammas < 1).any()):  # measured, not min(S, tau): the step moved the weights after S was seen
                with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16):
                    self.after_clip.append([i + 1, float(forward_max_logits(self.model, x).max())])
        self.losses.append(float(loss.detach()))
        self.max_logits.append(float(heads.max()))
        if not math.isfinite(self.losses[-1]):
            self.error = f"loss {self.losses[-1]} at step {i + 1}"

    def evaluate(self, corpus, eval_iters: int) -> float:
        from qkmla.train.data import fixed_windows

        self.model.eval()
        x, y = fixed_windows(corpus.val, eval_iters * self.train_config.batch_size, self.model.config.block_size)
        losses = []
        with torch.no_grad(), torch.autocast(self.ctx.device.type, dtype=torch.bfloat16):
            for xb, yb in zip(x.split(self.train_config.batch_size), y.split(self.train_config.batch_size)):
                losses.append(float(self.model(xb.to(self.ctx.device), yb.to(self.ctx.device))[1]))
        self.model.train()
        return sum(losses) / len(losses)

    def row(self) -> dict:
        n = len(self.losses)
        tail = self.losses[-min(10, n):] if n else []
        kept = [i for i in range(n) if (i + 1) % CURVE_EVERY == 0 or i == n - 1]  # the stored curves' steps
        return {"variant": self.variant, "lr": self.lr, "optimizer": OPTIMIZER, "steps": n,
                "train_loss_last10": sum(tail) / len(tail) if tail else None,
                "peak_max_logit": max(self.max_logits) if self.max_logits else None,
                "last_max_logit": self.max_logits[-1] if self.max_logits else None,
                "clipped_steps": len(self.after_clip) if self.train_config.qk_clip is not None else None,
                "peak_max_logit_after_clip": max((v for _, v in self.after_clip), default=None),
                "max_logit_after_clip": self.after_clip,
                "error": self.error,
                "loss_curve": [[i + 1, self.losses[i]] for i in kept],
                "max_logit_curve": [[i + 1, self.max_logits[i]] for i in kept]}


def run(ctx: PartContext) -> None:
    from qkmla.train.data import Corpus

    cfg = DRY if ctx.dry_run else REAL
    corpus = Corpus.load("tiny_shakespeare", "char")
    runs = [Run(ctx, v, lr, cfg, corpus.tokenizer.vocab_size) for v in variants(cfg["tau"]) for lr in cfg["lrs"]]
    ctx.record.update(preset=cfg["preset"], batch=cfg["batch"], lrs=list(cfg["lrs"]), optimizer=OPTIMIZER,
                      schedule=f"constant after {cfg['warmup']} warm-up steps", seed=runs[0].train_config.seed,
                      data="tiny_shakespeare (char)", params={r.variant: sum(p.numel() for p in r.model.parameters())
                                                              for r in runs})
    round_s, eval_s = 0.0, 0.0
    for step in range(1, cfg["max_steps"] + 1):
        live = [r for r in runs if r.error is None]
        # room for one more round of steps and the evaluation (about 1.5 rounds per eval batch)
        if not live or ctx.out_of_time(reserve_s=round_s + eval_s + 10):
            break
        t0 = time.monotonic()
        for r in live:
            r.step(corpus)
        ctx.sync()
        round_s = time.monotonic() - t0
        eval_s = 0.5 * round_s * cfg["eval_iters"]  # a forward is about a third of a training step
        if step % 50 == 0:
            ctx.log(f"step {step}: " + ", ".join(f"{r.variant}@{r.lr:g} {r.losses[-1]:.3f}"
                                                                for r in live))
            ctx.record["rows"] = [r.row() for r in runs]
            ctx.save()
    if not runs[0].losses:
        ctx.record.update(status="skipped", reason="no time was left for one round of steps")
    rows = []
    for r in runs:
        row = r.row()
        if r.error is None and r.losses:
            row["val_loss"] = r.evaluate(corpus, cfg["eval_iters"])
        rows.append(row)
    ctx.record["rows"] = rows
    best = {}
    for row in rows:
        if row.get("val_loss") is None:
            continue
        if row["variant"] not in best or row["val_loss"] < best[row["variant"]]["val_loss"]:
            best[row["variant"]] = row
    ctx.record["best_lr_at_horizon"] = {v: {"lr": r["lr"], "val_loss": r["val_loss"], "steps": r["steps"]}
                                        for v, r in best.items()}


def summarize(record: dict) -> list[str]:
    lines = [f"{record.get('preset')} shape, {record.get('data')}, batch {record.get('batch')}, "
             f"{record.get('optimizer')}, {record.get('schedule')}, seed {record.get('seed')}, learning rates "
             f"{record.get('lrs')}: one seed and {len(record.get('lrs') or [])} learning rate(s) per variant, so a "
             "short comparison and not a result.", ""]
    body = [[r["variant"], fmt(r["lr"], 3), r["steps"], fmt(r["train_loss_last10"], 4), fmt(r.get("val_loss"), 4),
             fmt(r["peak_max_logit"], 1), fmt(r["last_max_logit"], 1), fmt(r["clipped_steps"]),
             fmt(r.get("peak_max_logit_after_clip"), 1), r.get("error") or ""]
            for r in record.get("rows", [])]
    lines += table(["variant", "lr", "steps", "train loss (last 10)", "val loss", "peak max logit", "last max logit",
                    "clipped steps", "peak max logit after a clip", "error"], body)
    return lines
