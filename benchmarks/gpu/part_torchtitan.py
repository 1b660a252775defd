"""Part 6 (with the time that is left): pretraining throughput on torchtitan's DeepSeek-V3, plain,
QK-normed and with QK-Clip, and a short loss comparison.

The ``h200`` flavor of ``qkmla.integrations.torchtitan.flavors`` (1.88B parameters: 16 layers of
dim 2048, 16 heads, d_c 512, 16 experts top-2; DeepSeek-V3's router), each arm built as
``benchmarks.torchtitan_pretrain`` builds it (torchtitan's config, qkmla's overrides, torchtitan's
optimizer container and ``apply_compile``; FlexAttention), bf16 autocast over float32 weights,
AdamW, batch 4 x 4096 tokens of the embedded Shakespeare's bytes. One arm at a time (three would
not fit together): its first steps compile, then ``timed_steps`` are timed. Reports tokens/s, MFU
(torchtitan's FLOPs per token for the model over the GPU's dense bf16 peak, torchtitan's table;
only the QK-Clip arm measures its max logits, which is its cost),
peak memory, the ratio to plain, and the loss after the same steps on the same batches. The loss
comparison is a few hundred steps at one seed: descriptive, no claim.

Needs torchtitan (``qkmla[torchtitan]``): on a machine without it the part is skipped, naming it.
"""

from __future__ import annotations

import time

import torch

from .suite import PartContext, fmt, free_memory, reset_compiler, run_unit, table

REAL = dict(flavor="h200", batch=4, seq=4096, warmup_steps=3, timed_steps=10, loss_steps=150, lr=3e-4, tau=100.0)
DRY = dict(flavor="cpu", batch=2, seq=32, warmup_steps=1, timed_steps=1, loss_steps=2, lr=3e-3, tau=0.1)
ARMS = ("plain", "qk_norm", "qk_clip")


def arm_row(ctx: PartContext, name: str, cfg: dict, data: torch.Tensor) -> dict:
    from torchtitan.tools.utils import get_peak_flops

    from qkmla.integrations.torchtitan.attention import qk_attention_layers

    from .. import torchtitan_pretrain as recipe

    reset_compiler()
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    model, optimizer = recipe.build_arm(name, cfg["flavor"], cfg["lr"], cfg["tau"], compile=True,
                                        device=str(ctx.device), backend="aot_eager" if ctx.dry_run else "inductor")
    for _, layer in qk_attention_layers(model):  # only QK-Clip measures: the others' cost is the model's
        layer.track_max_logits = layer.qk_clip_tau is not None
    masks = recipe.masks_for(cfg["batch"], cfg["seq"], str(ctx.device))
    generator = torch.Generator().manual_seed(0)
    losses, seconds = [], []
    model.train()
    for step in range(cfg["warmup_steps"] + max(cfg["timed_steps"], cfg["loss_steps"])):
        starts = torch.randint(0, len(data) - cfg["seq"] - 1, (cfg["batch"],), generator=generator)
        batch = torch.stack([data[s:s + cfg["seq"] + 1] for s in starts]).to(ctx.device)
        ctx.sync()
        t0 = time.perf_counter()
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.device.type == "cuda"):
            loss = recipe.loss_of(model, batch, masks)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ctx.sync()
        if cfg["warmup_steps"] <= step < cfg["warmup_steps"] + cfg["timed_steps"]:
            seconds.append(time.perf_counter() - t0)
        losses.append(round(loss.item(), 4))
        if ctx.out_of_time(reserve_s=20) and len(seconds) >= cfg["timed_steps"]:
            break
    seconds.sort()
    per_step = seconds[len(seconds) // 2]
    tokens_per_s = cfg["batch"] * cfg["seq"] / per_step
    params, flops_per_token = model.config.get_nparams_and_flops(model, cfg["seq"])
    peak = get_peak_flops(torch.cuda.get_device_name(ctx.device)) if ctx.device.type == "cuda" else None
    row = {"arm": name, "flavor": cfg["flavor"], "params": params, "batch": cfg["batch"], "seq": cfg["seq"],
           "seconds_per_step": per_step, "tokens_per_s": tokens_per_s, "timed_steps": len(seconds),
           "mfu": tokens_per_s * flops_per_token / peak if peak else None,
           "peak_memory_gib": torch.cuda.max_memory_allocated(ctx.device) / 2 ** 30 if ctx.device.type == "cuda"
           else None, "losses": losses, "steps": len(losses), "precision": "bf16 autocast, float32 weights"}
    clipped = [float(layer.clipped_max_logits.max()) for _, layer in qk_attention_layers(model)
               if layer.clipped_max_logits is not None]
    row["max_logit_after_last_clip"] = max(clipped) if clipped else None
    del model, optimizer
    free_memory()
    return row


def run(ctx: PartContext) -> None:
    if ctx.skipped_without("torchtitan", "pip install 'qkmla[torchtitan]', or carry its wheels with --wheels"):
        return
    from qkmla.train.data import load_text, split_by_play

    cfg = DRY if ctx.dry_run else REAL
    data = torch.tensor(list(split_by_play(load_text("shakespeare"))["train"].encode()))
    ctx.record.update(config=cfg, rows=[])
    for name in ARMS:
        if ctx.out_of_time(reserve_s=0 if ctx.dry_run else 60):
            ctx.record.setdefault("not_run", []).append(name)
            ctx.record["status"] = "partial"
            continue
        run_unit(ctx, name, lambda: [arm_row(ctx, name, cfg, data)])
    rows = {r["arm"]: r for r in ctx.record["rows"]}
    for r in ctx.record["rows"]:
        r["ratio_to_plain"] = r["seconds_per_step"] / rows["plain"]["seconds_per_step"] if "plain" in rows else None


def summarize(record: dict) -> list[str]:
    if record.get("status") == "skipped":
        return [f"- skipped: {record.get('reason')}"]
    rows = record.get("rows", [])
    steps = min((r["steps"] for r in rows), default=0)
    body = [[r["arm"], r["flavor"], f"{r['batch']} x {r['seq']}", fmt(1e3 * r["seconds_per_step"], 1),
             fmt(r["tokens_per_s"], 0), fmt(r.get("ratio_to_plain"), 3), fmt(r["mfu"] and 100 * r["mfu"], 1, "%"),
             fmt(r["peak_memory_gib"], 1), fmt(r["losses"][steps - 1] if steps else None, 4)] for r in rows]
    lines = table(["arm", "flavor", "batch", "ms / step", "tokens/s", "over plain", "MFU", "peak GiB",
                   f"loss at step {steps}"], body)
    for e in record.get("errors", []):
        lines.append(f"- error: {e}")
    if record.get("not_run"):
        lines.append(f"- not run (out of time): {', '.join(record['not_run'])}")
    return lines
