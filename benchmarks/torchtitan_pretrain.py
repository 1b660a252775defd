"""Pretraining with torchtitan's DeepSeek-V3: plain, QK-normed and with QK-Clip, side by side.

    python -m benchmarks.torchtitan_pretrain [--flavor cpu] [--steps 300] [--batch 8] [--seq 256]
        [--no-compile] [--out FILE.json] [--overwrite]

torchtitan's Trainer does not run on a CPU-only PyTorch (docs/torchtitan.md, "On a CPU"), so this runs
its parts in one loop: the model config of a qkmla flavor (``integrations.torchtitan.flavors``, DeepSeek-V3's
router and shapes) with each arm's overrides applied by torchtitan's own override mechanism, the model
built as its Trainer builds it, torchtitan's optimizer container (AdamW; for QK-Clip, qkmla's container that
clips after each step), and torchtitan's ``apply_compile`` (each block, fullgraph, inductor). On a GPU,
the same arms run under torchtitan's Trainer (``benchmarks/gpu``).

Arms (the paper's comparison): ``plain`` (``max_logits``), ``qk_norm`` (RMS blockwise, the paper's method)
and ``qk_clip`` (tau, Kimi K2's 100 by default). The same initial weights (plain's copied into the
others, the norm weights at ones), the same batches of the embedded Shakespeare's training plays in the
same order, the same learning rate. Each step runs the three arms in a rotating order, so machine noise
falls on all alike. Every ``--measure-every`` steps the plain and QK-normed arms also measure their max
logits (QK-Clip measures at every step: that is its cost); those steps are not timed.

Reports per arm: median step seconds, tokens/s, the median per-step ratio to plain, loss every
``--log-every`` steps, validation loss (held-out plays) at the end, and each layer's max logit over
the measured steps. Target: the QK-normed step within 1.05x of plain's under torch.compile. The
loss figures are descriptive: one seed, no claim about which arm trains better.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types
from pathlib import Path

import torch

from .common import positive, start_record

HERE = Path(__file__).resolve().parent
ARMS = {"plain": ["max_logits"], "qk_norm": [("qk_norm", {})], "qk_clip": ["qk_clip", "qk_clip_optimizer"]}
TARGET = 1.05


def build_arm(name: str, flavor: str, lr: float, tau: float, compile: bool, device: str = "cpu", backend="inductor"):
    """(model, optimizer container) of one arm, built through torchtitan's config and override mechanism,
    on ``device`` (the CPU: the dense-mask inner attention; CUDA: torchtitan's FlexAttention)."""
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, derive
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    from qkmla.integrations.torchtitan.flavors import materialize, model_config
    from qkmla.integrations.torchtitan.inner import DenseMaskAttention

    config = deepseek_v3_debugmodel()  # torchtitan's Trainer.Config: its optimizer and override fields
    config.model_spec.model = model_config(flavor)
    for layer in config.model_spec.model.layers:
        if torch.device(device).type == "cpu":
            layer.attention.inner_attention = derive(layer.attention.inner_attention, DenseMaskAttention.Config)
    config.optimizer = default_adamw(lr=lr)
    prefix = "qkmla.integrations.torchtitan.overrides."
    imports = [prefix + o if isinstance(o, str) else (prefix + o[0], o[1]) for o in ARMS[name]]
    if name == "qk_clip":
        imports[0] = (imports[0], {"tau": tau})
    config.override = OverrideConfig(imports=imports)
    apply_overrides(config.override, config)
    model = materialize(config.model_spec.model, device, seed=0)
    if compile:
        apply_compile(model, compile_config=CompileConfig(enable=True, backend=backend),
                      parallel_dims=types.SimpleNamespace(tp_enabled=False))
    return model, config.optimizer.build(model_parts=[model])


def share_weights(models: dict) -> None:
    """Every arm starts from the plain arm's weights (what the norm adds stays at its init)."""
    state = models["plain"][0].state_dict()
    for name, (model, _) in models.items():
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and all("head_norm" in k or "logit_scale" in k for k in missing), (name, missing)


def masks_for(batch: int, seq: int, device: str = "cpu"):
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import get_causal_mask_mod

    return create_block_mask(get_causal_mask_mod(), batch, None, seq, seq, device=device)


def loss_of(model, tokens: torch.Tensor, masks) -> torch.Tensor:
    B, L = tokens.shape[0], tokens.shape[1] - 1
    logits = model(tokens[:, :-1], positions=torch.arange(L, device=tokens.device).expand(B, -1),
                   attention_masks=masks)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="cpu", choices=["cpu", "h200"])
    p.add_argument("--steps", type=positive, default=300)
    p.add_argument("--batch", type=positive, default=8)
    p.add_argument("--seq", type=positive, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tau", type=float, default=100.0, help="QK-Clip's threshold (Kimi K2: 100)")
    p.add_argument("--measure-every", type=positive, default=10)
    p.add_argument("--log-every", type=positive, default=25)
    p.add_argument("--warmup", type=int, default=5, help="first steps not timed (compilation)")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "torchtitan_pretrain_cpu.json")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    if not 0 < args.lr < 1 or not args.tau > 0 or args.warmup < 0:
        p.error("--lr: expected a number in (0, 1); --tau: > 0; --warmup: >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    compiled = not args.no_compile
    # Three arms' blocks share one compiled code object: train steps with and without measuring, then
    # evaluation, each a graph per arm and block kind, which torchtitan's fullgraph compile must not
    # run out of (dynamo's default allows 8).
    torch._dynamo.config.recompile_limit = 64
    record, write = start_record(p, args, __spec__.name, argv, load_at_start=True, flavor=args.flavor,
                                steps=args.steps, batch=args.batch, seq=args.seq, lr=args.lr, tau=args.tau,
                                compile=compiled, target_qk_norm_over_plain=TARGET, status="running")
    import torchtitan

    record["torchtitan"] = torchtitan.__version__
    try:
        return run(args, record, write)
    except BaseException as e:  # the record keeps what was measured, and says what stopped it
        record.update(status="failed", error=f"{type(e).__name__}: {e}")
        write()
        raise


def run(args, record: dict, write) -> int:
    """The three arms' training, then their validation; fills and writes ``record``."""
    from qkmla.integrations.torchtitan.attention import close_steps, qk_attention_layers
    from qkmla.train.data import load_text, split_by_play

    compiled = not args.no_compile
    splits = split_by_play(load_text("shakespeare"))
    train, val = (torch.tensor(list(splits[s].encode())) for s in ("train", "val"))
    models = {name: build_arm(name, args.flavor, args.lr, args.tau, compiled) for name in ARMS}
    share_weights(models)
    record["parameters"] = sum(p.numel() for p in models["plain"][0].parameters())
    masks = masks_for(args.batch, args.seq)
    generator = torch.Generator().manual_seed(0)
    times = {name: [] for name in ARMS}
    losses = {name: [] for name in ARMS}
    max_logits = {name: {} for name in ARMS}
    after_clip = {}
    names = list(ARMS)
    for step in range(args.steps):
        starts = torch.randint(0, len(train) - args.seq - 1, (args.batch,), generator=generator)
        batch = torch.stack([train[s:s + args.seq + 1] for s in starts])
        measure = step % args.measure_every == 0
        order = names[step % 3:] + names[:step % 3]
        for name in order:
            model, optimizer = models[name]
            model.train()
            for _, layer in qk_attention_layers(model):
                layer.track_max_logits = measure or layer.qk_clip_tau is not None
            t0 = time.perf_counter()
            loss = loss_of(model, batch, masks)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # QK-Clip's container clips here (closing the step's max logits)
            seconds = time.perf_counter() - t0
            if not measure and step >= args.warmup:
                times[name].append(seconds)
            if measure:
                closed = close_steps(model) if name != "qk_clip" else {
                    n: layer.step_max_logits for n, layer in qk_attention_layers(model)}
                for layer_name, value in closed.items():
                    max_logits[name].setdefault(layer_name, []).append(round(float(value.max()), 4))
                for layer_name, layer in qk_attention_layers(model):
                    if layer.clipped_max_logits is not None:  # QK-Clip: the same logits after this step's clip
                        after_clip.setdefault(layer_name, []).append(round(float(layer.clipped_max_logits.max()), 4))
            if step % args.log_every == 0 or step == args.steps - 1:
                losses[name].append([step, round(loss.item(), 4)])
        if step % args.log_every == 0:
            print(f"step {step}: " + ", ".join(f"{n} {losses[n][-1][1]:.3f}" for n in names), flush=True)
            record.update(losses=losses, max_logits_per_layer=max_logits, qk_clip_max_logits_after_clip=after_clip,
                          step_seconds={n: [round(t, 4) for t in times[n]] for n in names})
            write()
    summary = {}
    plain_times = times["plain"]
    for name in names:
        model = models[name][0]
        model.eval()
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            starts = torch.randint(0, len(val) - args.seq - 1, (4 * args.batch,), generator=g)
            val_batches = torch.stack([val[s:s + args.seq + 1] for s in starts]).split(args.batch)
            val_loss = statistics.fmean(loss_of(model, b, masks).item() for b in val_batches)
        med = statistics.median(times[name])
        ratios = [t / q for t, q in zip(times[name], plain_times)]
        summary[name] = {"median_step_s": round(med, 4), "tokens_per_s": round(args.batch * args.seq / med, 1),
                         "median_step_ratio_to_plain": round(statistics.median(ratios), 4),
                         "timed_steps": len(times[name]), "final_train_loss": losses[name][-1][1],
                         "val_loss": round(val_loss, 4),
                         "max_logit_last_measured": max((v[-1] for v in max_logits[name].values()), default=None)}
    ratio = summary["qk_norm"]["median_step_ratio_to_plain"]
    record.update(summary=summary, losses=losses, max_logits_per_layer=max_logits,
                  qk_clip_max_logits_after_clip=after_clip, status="complete", qk_norm_within_target=ratio <= TARGET)
    write()
    for name, s in summary.items():
        print(f"{name:8s} {s['median_step_s']:.4f} s/step  {s['tokens_per_s']:8.1f} tok/s  "
              f"x{s['median_step_ratio_to_plain']:.3f}  val {s['val_loss']:.4f}  "
              f"max logit {s['max_logit_last_measured']}")
    print(f"qk_norm / plain = {ratio:.4f} (target <= {TARGET}): {'met' if ratio <= TARGET else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
