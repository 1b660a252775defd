"""The training loop every experiment builds on.

Per step it logs train loss, learning rate, gradient norm, the max pre-softmax attention
logit of every layer (and of every head with ``log_heads``), tokens/s and the seconds spent
measuring the max logits; with QK-Clip also the number of clipped heads and the max logit
after the clip (``max_logit`` is the one the step's forward saw). Every ``eval_interval``
steps: validation loss over fixed windows (the same for every seed, so runs compare), and
for QK-normed layers the bound their norm weights put on the logits (``logit_bound``, see
``diagnostics.py``) and the mean learned logit scale. Rows go to
``out/metrics.jsonl`` as they happen. Checkpoints (safetensors) are written every
``ckpt_interval`` steps and at the end; a run that reaches a NaN/inf loss or gradient stops,
records the step in ``out/status.json`` and keeps its last good checkpoint.

Under ``torchrun`` (WORLD_SIZE > 1) the model is wrapped in DDP (or sharded with FSDP2 when
``fsdp``): every rank draws the same global batch and trains on its slice, so the losses
equal a single process with the same global batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from ..attention.qk_clip import qk_clip_
from ..model.gpt import GPT, GPT_PRESETS, GPTConfig
from .checkpoint import FILENAME, load_checkpoint, save_checkpoint
from .data import Corpus, fixed_windows, get_batch
from .diagnostics import logit_bound, logit_scale
from .optim import build_optimizer, lr_multiplier, set_lr


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
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    qk_clip: Optional[float] = None
    qk_clip_alpha: float = 0.5
    eval_interval: int = 50
    eval_iters: int = 10
    ckpt_interval: int = 100
    log_heads: bool = False
    data: str = "tiny_shakespeare"
    tokenizer: str = "char"
    seed: int = 1337
    out: str = "runs/default"
    resume: bool = False
    max_seconds: Optional[float] = None
    progress: bool = True
    fsdp: bool = False
    model_overrides: dict = field(default_factory=dict)

    def model_config(self, vocab_size: int) -> GPTConfig:
        if self.preset not in GPT_PRESETS:
            raise ValueError(f"preset: expected one of {sorted(GPT_PRESETS)}, got {self.preset!r}")
        changes = dict(self.model_overrides, attn=self.attn, vocab_size=vocab_size)
        if self.block_size is not None:
            changes["block_size"] = self.block_size
        for name in ("qk_norm_p", "learnable_logit_scale", "softmax_scale"):
            if getattr(self, name) is not None:
                changes[name] = getattr(self, name)
        return GPT_PRESETS[self.preset].replace(**changes)


def attention_modules(model: torch.nn.Module) -> list:
    return [block.attn for block in model.blocks]


class NonFiniteError(RuntimeError):
    pass


def _dist_info() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _save(out, model, optimizer, step, run_config, generator, fsdp: bool, rank: int) -> None:
    """Every rank takes part in gathering sharded state; rank 0 writes the file."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(model, options=opts)
        optim_state = get_optimizer_state_dict(model, optimizer.optimizers, options=opts)
    else:
        model_state, optim_state = model.state_dict(), optimizer.state_dict()
    if rank == 0:
        save_checkpoint(out, model_state, optim_state, step, run_config, generator)


def _load_states(model, optimizer, model_state: dict, optim_state: dict, fsdp: bool) -> None:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=opts)
        set_optimizer_state_dict(model, optimizer.optimizers, optim_state, options=opts)
    else:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)


@torch.no_grad()
def evaluate(model: GPT, data: torch.Tensor, config: TrainConfig, block_size: int) -> float:
    """Mean loss over ``eval_iters`` batches of windows spread evenly over ``data``: the same
    windows at every evaluation, for every seed and every run of this size."""
    model.eval()
    x, y = fixed_windows(data, config.eval_iters * config.batch_size, block_size)
    losses = [model(xb, yb)[1].item() for xb, yb in zip(x.split(config.batch_size), y.split(config.batch_size))]
    model.train()
    return sum(losses) / len(losses)


def _weight_diagnostics(attns: list) -> dict:
    """The logit bound of the QK-normed layers and their mean learned logit scale, if any."""
    row = {}
    bounds = [b for b in map(logit_bound, attns) if b is not None]
    if bounds:
        row["logit_bound"] = max(bounds)
    scales = [s for s in map(logit_scale, attns) if s is not None]
    if scales:
        row["logit_scale"] = sum(scales) / len(scales)
    return row


def train(config: TrainConfig) -> dict:
    """Run (or resume) a training run; returns a summary dict (also in ``out/status.json``)."""
    rank, world = _dist_info()
    if config.batch_size % world:
        raise ValueError(f"batch_size: the global batch {config.batch_size} must split evenly over {world} ranks")
    if config.qk_clip is not None and config.attn not in ("mla", "mha", "gqa", "mqa"):
        raise ValueError(f"qk_clip: applies to attention without QK norm (mla, mha, gqa, mqa), got attn={config.attn!r}")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    corpus = Corpus.load(config.data, config.tokenizer)
    model_cfg = config.model_config(corpus.tokenizer.vocab_size)
    model = GPT(model_cfg)
    fsdp = world > 1 and config.fsdp
    if fsdp:  # shard before the optimizer sees the parameters: fully_shard replaces them
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = build_optimizer(model, config.optimizer, config.lr, config.weight_decay,
                                muon_adjust_lr=config.muon_adjust_lr)
    generator = torch.Generator().manual_seed(config.seed)
    start = 0
    if config.resume and (out / FILENAME).is_file():
        model_state, optim_state, start = load_checkpoint(out / FILENAME, generator)
        _load_states(model, optimizer, model_state, optim_state, fsdp)
    elif config.resume:
        raise ValueError(f"resume: no checkpoint in {out}")
    run_config = {"train": dataclasses.asdict(config), "model": dataclasses.asdict(model_cfg),
                  "tokenizer": corpus.tokenizer.state()}
    if rank == 0:
        (out / "config.json").write_text(json.dumps(run_config, indent=1))

    wrapped = model
    if world > 1 and not fsdp:
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    attns = attention_modules(model)
    for a in attns:
        a.track_max_logits = True

    block_size = model_cfg.block_size
    local = config.batch_size // world
    metrics_path = out / "metrics.jsonl"
    if rank == 0:  # a resumed run drops rows logged after its checkpoint, so no step repeats
        kept = []
        if config.resume and metrics_path.is_file():
            kept = [ln for ln in metrics_path.read_text().splitlines() if ln and json.loads(ln)["step"] <= start]
        metrics_path.write_text("".join(ln + "\n" for ln in kept))
    status = {"status": "running", "step": start, "out": str(out)}
    bar = None
    if rank == 0 and config.progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=start, desc=f"{config.attn}", unit="step", dynamic_ncols=True)
    t_start = time.perf_counter()
    step = start
    try:
        for step in range(start, config.steps):
            mult = lr_multiplier(step, config.steps, config.schedule, config.warmup_steps, config.min_lr_ratio)
            set_lr(optimizer, mult)
            x, y = get_batch(corpus.train, config.batch_size, block_size, generator)
            x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
            t0 = time.perf_counter()
            _, loss = wrapped(x, y)
            loss_value = loss.detach()
            if world > 1:
                dist.all_reduce(loss_value)
                loss_value /= world
            if not math.isfinite(loss_value.item()):
                raise NonFiniteError(f"loss is {loss_value.item()} at step {step}")
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip or float("inf"))
            if not math.isfinite(float(grad_norm)):
                raise NonFiniteError(f"gradient norm is {float(grad_norm)} at step {step}")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            heads = torch.stack([a.last_max_logits.float() for a in attns])  # [layers, h]
            if world > 1:
                dist.all_reduce(heads, op=dist.ReduceOp.MAX)
            gammas = None
            if config.qk_clip is not None:
                gammas = torch.stack([qk_clip_(a, m, config.qk_clip, config.qk_clip_alpha) for a, m in zip(attns, heads)])
            dt = time.perf_counter() - t0
            row = {"step": step + 1, "loss": loss_value.item(), "lr": optimizer.param_groups[0]["lr"],
                   "grad_norm": float(grad_norm), "max_logit": float(heads.max()),
                   "max_logit_per_layer": [round(float(v), 4) for v in heads.amax(dim=1)],
                   "tokens_per_s": config.batch_size * block_size / dt,
                   "max_logit_seconds": sum(a.max_logit_seconds for a in attns), "step_seconds": dt}
            if config.log_heads:
                row["max_logit_per_head"] = [[round(float(v), 4) for v in layer] for layer in heads]
            if gammas is not None:  # each head's logits were multiplied by exactly its gamma
                row["clipped_heads"] = int((gammas < 1).sum())
                row["max_logit_post_clip"] = float((heads * gammas.to(heads.dtype)).max())
            if (step + 1) % config.eval_interval == 0 or step + 1 == config.steps:
                row["val_loss"] = evaluate(model, corpus.val, config, block_size)
                row.update(_weight_diagnostics(attns))
            if rank == 0:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", max_logit=f"{row['max_logit']:.1f}",
                                    **({"val": f"{row['val_loss']:.3f}"} if "val_loss" in row else {}))
            if (step + 1) % config.ckpt_interval == 0 or step + 1 == config.steps:
                _save(out, model, optimizer, step + 1, run_config, generator, fsdp, rank)
            status.update(step=step + 1, loss=row["loss"], val_loss=row.get("val_loss", status.get("val_loss")))
            if config.max_seconds is not None and time.perf_counter() - t_start > config.max_seconds:
                _save(out, model, optimizer, step + 1, run_config, generator, fsdp, rank)
                status["status"] = "time limit"
                break
        else:
            status["status"] = "done"
    except NonFiniteError as e:
        status.update(status="non-finite", step=step, error=str(e),
                      last_checkpoint=str(out / FILENAME) if (out / FILENAME).is_file() else None)
    finally:
        if bar is not None:
            bar.close()
        for a in attns:
            a.track_max_logits = False
        status["seconds"] = time.perf_counter() - t_start
        if rank == 0:
            (out / "status.json").write_text(json.dumps(status, indent=1))
    return status


def load_model(run_dir: str | Path) -> tuple[GPT, "Tokenizer"]:  # noqa: F821
    """The trained model and tokenizer of a run directory."""
    from .checkpoint import read_checkpoint
    from .data import Tokenizer

    state, _, meta = read_checkpoint(run_dir)
    cfg = json.loads(meta["config"])
    model = GPT(GPTConfig(**cfg["model"]))
    model.load_state_dict(state)
    tok = cfg["tokenizer"]
    return model.eval(), Tokenizer(tok["kind"], tok["chars"])
