"""Part 4: training throughput of mla-qknorm against mla.

The ``shakespeare`` (nanoGPT's GPU config: batch 64 x 256) and ``paper-400m`` (batch 12 x
1024) presets, random tokens, bf16 autocast over float32 weights, AdamW. A step is forward,
backward, optimizer step (max-logit tracking off: the model's cost, not the diagnostic's).
Eager for both presets first, then ``torch.compile(model)`` (default mode) while time
lasts. Within a preset and mode the two variants alternate round by round; seconds per
step are the median over rounds. Each row names the SDPA kernel its forward dispatched
(the aten op ``scaled_dot_product_attention`` resolved to: flash, memory-efficient, cuDNN or
math). Under autocast the RMSNorms inside attention (the latent norms, and the QK norms of
mla-qknorm) get bf16 activations with float32 weights, which eager PyTorch may run unfused
(on the CPU it warns that it does); the compiled rows fuse them.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .suite import PartContext, fmt, free_memory, reset_compiler, run_unit, table

REAL = dict(presets=(("shakespeare", 64), ("paper-400m", 12)), rounds=5, steps_per_round=3)
DRY = dict(presets=(("debug", 2),), rounds=1, steps_per_round=1)
VARIANTS = ("mla", "mla-qknorm")
MODES = ("eager", "compiled")
# Seconds a (preset, mode) needs before it is worth starting: guesses, not measurements (inductor
# compiles a model's forward and backward once per variant); a unit that does not fit is skipped.
MIN_SECONDS = {("shakespeare", "compiled"): 90, ("paper-400m", "compiled"): 180}


class _SdpaOps(TorchDispatchMode):
    """Names of the SDPA kernels (aten ops) dispatched while active."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "attention" in name and not name.endswith("backward"):
            self.names.add(name)
        return func(*args, **(kwargs or {}))


class Trainer:
    """One model, its optimizer and a fixed batch; ``step()`` runs one training step."""

    def __init__(self, ctx: PartContext, preset: str, attn: str, batch: int, compiled: bool):
        from qkmla.model.gpt import GPT, GPT_PRESETS
        from qkmla.train.optim import build_optimizer

        torch.manual_seed(0)
        self.ctx = ctx
        with torch.device(ctx.device):  # initialized where it trains
            self.model = GPT(GPT_PRESETS[preset].replace(attn=attn, dropout=0.0))
        self.opt = build_optimizer(self.model, "adamw", 1e-4)
        T = self.model.config.block_size
        self.tokens = batch * T
        gen = torch.Generator(device=ctx.device).manual_seed(0)
        self.x = torch.randint(0, self.model.config.vocab_size, (batch, T + 1), device=ctx.device, generator=gen)
        backend = {"backend": "eager"} if ctx.dry_run else {}  # the dry run: dynamo's capture, quickly
        self.forward = torch.compile(self.model, **backend) if compiled else self.model

    def step(self) -> None:
        with torch.autocast(self.ctx.device.type, dtype=torch.bfloat16):
            _, loss = self.forward(self.x[:, :-1], self.x[:, 1:])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def sdpa_kernels(self) -> list[str]:
        with _SdpaOps() as ops, torch.autocast(self.ctx.device.type, dtype=torch.bfloat16), torch.no_grad():
            self.model(self.x[:, :-1])
        return sorted(ops.names)


def time_pair(ctx: PartContext, preset: str, batch: int, mode: str, rounds: int, steps: int) -> list[dict]:
    """Both variants of one preset and mode, interleaved round by round."""
    reset_compiler()
    trainers = {v: Trainer(ctx, preset, v, batch, mode == "compiled") for v in VARIANTS}
    compile_s = {}
    for v, t in trainers.items():  # the first step compiles (or warms up) outside the timing
        t0 = time.monotonic()
        t.step()
        ctx.sync()
        compile_s[v] = round(time.monotonic() - t0, 2)
    samples = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for v, t in trainers.items():
            t.step()  # one untimed step after switching models
            ctx.sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                t.step()
            ctx.sync()
            samples[v].append((time.perf_counter() - t0) / steps)
        if ctx.out_of_time(reserve_s=10):
            break
    rows = []
    base = statistics.median(samples["mla"])
    for v, t in trainers.items():
        s = statistics.median(samples[v])
        rows.append({"preset": preset, "variant": v, "mode": mode, "batch": batch,
                     "block_size": t.model.config.block_size, "params": sum(p.numel() for p in t.model.parameters()),
                     "seconds_per_step": s, "tokens_per_s": t.tokens / s, "ratio_to_mla": s / base,
                     "rounds": len(samples[v]), "first_step_seconds": compile_s[v], "sdpa_kernels": t.sdpa_kernels(),
                     "precision": "bf16 autocast, float32 weights"})
    del trainers
    free_memory()
    return rows


def run(ctx: PartContext) -> None:
    cfg = DRY if ctx.dry_run else REAL
    ctx.record["rows"] = []
    plan = [(preset, batch, mode) for mode in MODES for preset, batch in cfg["presets"]]
    for preset, batch, mode in plan:
        needs = 0 if ctx.dry_run else MIN_SECONDS.get((preset, mode), 20)
        if ctx.out_of_time(reserve_s=needs + 10):
            ctx.record.setdefault("not_run", []).append(f"{preset} {mode} (needs about {needs} s, "
                                                        f"{max(0, ctx.time_left()):.0f} s left)")
            ctx.record["status"] = "partial"
            continue
        run_unit(ctx, f"{preset} {mode}",
                 lambda: time_pair(ctx, preset, batch, mode, cfg["rounds"], cfg["steps_per_round"]))


def summarize(record: dict) -> list[str]:
    body = [[r["preset"], r["mode"], r["variant"], r["batch"], fmt(1e3 * r["seconds_per_step"], 1),
             fmt(r["tokens_per_s"], 0), fmt(r["ratio_to_mla"], 3), ", ".join(r["sdpa_kernels"])]
            for r in record.get("rows", [])]
    lines = table(["preset", "mode", "variant", "batch", "ms / step", "tokens/s", "over mla", "SDPA kernel"], body)
    for e in record.get("errors", []):
        lines.append(f"- error: {e}")
    if record.get("not_run"):
        lines.append(f"- not run (out of time): {', '.join(record['not_run'])}")
    return lines
