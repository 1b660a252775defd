"""``lr-sweep``: learning rates from stable to unstable, for each stabilizer (the seed
paper's stress test, its Fig. 2, and Wortsman et al. 2023's learning-rate sensitivity).

Variants: plain MLA; QK-Clip MLA at tau = 100 (Kimi K2 and the paper) and at a tau tight
enough to trigger at this scale; QK-normed MLA (blockwise RMS, the paper's method); the
same with a learnable per-head logit scale (the remedy for the temperature cap of unit
norm weights, see ``qkmla.train.diagnostics``); MHA and MHA + QK-norm as references.
AdamW and Muon, each over 1e-3 .. 1e-1.

Reported per optimizer and variant: the loss-vs-lr curve with its seed spread, the best
loss at the variant's own best lr, the learning-rate sensitivity (the mean over the sweep of
min(loss, initial loss) minus the best; Wortsman et al.), peak max logit, divergences.
"""

from __future__ import annotations

import statistics

from .base import Experiment, Options, Report, train_settings
from .figures import fmt, pyplot, save, table
from .grid import Run
from .results import effective_loss, group, mean_std

LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
QUICK_LRS = (1e-3, 1e-1)
OPTIMIZERS = ("adamw", "muon")
STEPS = 300
TIGHT_TAU = 10.0  # about where QK-normed MLA's max logit sits here: both hold logits in one range

# variant -> (TrainConfig fields, seeds: "mla" variants get the full count, references one)
VARIANTS = {
    "mla": ({"attn": "mla"}, "full"),
    "mla-qkclip-100": ({"attn": "mla", "qk_clip": 100.0}, "full"),
    f"mla-qkclip-{TIGHT_TAU:g}": ({"attn": "mla", "qk_clip": TIGHT_TAU}, "full"),
    "mla-qknorm": ({"attn": "mla-qknorm"}, "full"),
    "mla-qknorm-scale": ({"attn": "mla-qknorm", "learnable_logit_scale": True}, "full"),
    "mha": ({"attn": "mha"}, "one"),
    "mha-qknorm": ({"attn": "mha-qknorm"}, "one"),
}


def plan(options: Options) -> list[Run]:
    seeds = options.seed_list(3)
    runs = []
    for optimizer in OPTIMIZERS:
        for lr in QUICK_LRS if options.quick else LRS:
            for variant, (fields, count) in VARIANTS.items():
                for seed in seeds if count == "full" else seeds[:1]:
                    train = train_settings(options.quick, STEPS, optimizer=optimizer, lr=lr, seed=seed, **fields)
                    runs.append(Run(f"{variant}_{optimizer}_lr{lr:g}_s{seed}", variant, train,
                                    {"optimizer": optimizer, "lr": lr, "seed": seed}))
    return runs


def variant_summary(rows: list[dict]) -> dict:
    """Per-lr means and spreads of one variant and optimizer, its best lr and sensitivity."""
    per_lr = []
    for (lr,), rs in sorted(group(rows, "lr").items()):
        losses = [effective_loss(r) for r in rs]
        mean, std = mean_std(losses)
        per_lr.append({"lr": lr, "mean": mean, "std": std, "min": min(losses), "max": max(losses),
                       "logit_bound": mean_std(r.get("logit_bound") for r in rs)[0],
                       "logit_scale": mean_std(r.get("logit_scale") for r in rs)[0],
                       "peak_max_logit": max(r["peak_max_logit"] or float("inf") for r in rs),
                       "diverged": [r["nan_step"] for r in rs if r["nan_step"] is not None], "seeds": len(rs)})
    best = min(per_lr, key=lambda e: e["mean"])
    return {"per_lr": per_lr, "best_lr": best["lr"], "best_loss": best["mean"], "best_loss_std": best["std"],
            "sensitivity": statistics.fmean(e["mean"] for e in per_lr) - best["mean"],
            "peak_max_logit": max(e["peak_max_logit"] for e in per_lr),
            "peak_max_logit_at_best_lr": best["peak_max_logit"],
            "logit_bound_at_best_lr": best["logit_bound"], "logit_scale_at_best_lr": best["logit_scale"],
            "divergences": sum(len(e["diverged"]) for e in per_lr),
            "first_divergence_step": min((s for e in per_lr for s in e["diverged"]), default=None)}


def report(rows: list[dict], options: Options) -> Report:
    summary = {opt: {v: variant_summary(rs) for (v,), rs in group([r for r in rows if r["optimizer"] == opt],
                                                                   "variant").items()}
               for opt in OPTIMIZERS}
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    for col, opt in enumerate(OPTIMIZERS):
        for i, (variant, s) in enumerate(summary[opt].items()):
            lrs = [e["lr"] for e in s["per_lr"]]
            style = dict(marker="os^vDPX"[i % 7], ms=4, lw=1.2, label=variant)
            line, = axes[0, col].plot(lrs, [e["mean"] for e in s["per_lr"]], **style)
            axes[0, col].fill_between(lrs, [e["min"] for e in s["per_lr"]], [e["max"] for e in s["per_lr"]],
                                      color=line.get_color(), alpha=0.15)
            axes[1, col].plot(lrs, [e["peak_max_logit"] for e in s["per_lr"]], color=line.get_color(), **style)
        if any(effective_loss(r) == r["initial_loss"] for r in rows if r["optimizer"] == opt):
            axes[0, col].axhline(rows[0]["initial_loss"], color="k", ls="--", lw=0.7, label="ln V (no learning)")
        for tau in (100.0, TIGHT_TAU):
            axes[1, col].axhline(tau, color="gray", ls=":", lw=0.7)
        axes[0, col].set_title(f"{opt}: final validation loss (diverged = ln V), seed min-max band")
        axes[1, col].set_title(f"{opt}: peak max attention logit over training")
        axes[1, col].set_yscale("log")
        for ax in axes[:, col]:
            ax.set_xscale("log")
            ax.set_xlabel("peak learning rate")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    figures = [save(fig, options.out / "lr_sweep.png")]

    header = ["optimizer", "variant", "best lr", "best loss (mean ± std)", "lr sensitivity", "peak max logit",
              "max logit at best lr", "logit bound at best lr", "diverged runs (first step)"]
    lines = []
    for opt in OPTIMIZERS:
        for variant, s in summary[opt].items():
            div = f"{s['divergences']}" + (f" ({s['first_divergence_step']})" if s["divergences"] else "")
            lines.append([opt, variant, f"{s['best_lr']:g}", f"{fmt(s['best_loss'])} ± {fmt(s['best_loss_std'])}",
                          fmt(s["sensitivity"]), fmt(s["peak_max_logit"], ".1f"),
                          fmt(s["peak_max_logit_at_best_lr"], ".1f"), fmt(s["logit_bound_at_best_lr"], ".1f"), div])
    loss_header = ["optimizer", "variant"] + [f"lr {lr:g}" for lr in (QUICK_LRS if options.quick else LRS)]
    loss_lines = [[opt, v] + [f"{fmt(e['mean'], '.3f')} ± {fmt(e['std'], '.3f')}" for e in s["per_lr"]]
                  for opt in OPTIMIZERS for v, s in summary[opt].items()]
    bound_lines = [[opt, v] + [fmt(e["logit_bound"], ".1f") for e in s["per_lr"]]
                   for opt in OPTIMIZERS for v, s in summary[opt].items() if s["per_lr"][0]["logit_bound"] is not None]
    text = table(header, lines) + "\nFinal validation loss by learning rate (mean ± std over seeds; " \
        "diverged = ln V):\n\n" + table(loss_header, loss_lines) + "\nLogit bound of the QK-normed layers at the end (the most any input " \
        "could reach with the learned norm weights and scale; mean over seeds):\n\n" + table(loss_header, bound_lines)
    return Report(summary, text, figures)


EXPERIMENT = Experiment("lr-sweep", "loss and max logit vs learning rate: plain, QK-Clip, QK-norm MLA (+ MHA refs)",
                        plan, report)
