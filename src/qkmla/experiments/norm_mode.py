"""``norm-mode``: blockwise against unified QK RMSNorm on MLA (the seed paper's Appendix B):
validation loss over seeds and the training step time, side by side in one grid."""

from __future__ import annotations

from .base import Experiment, Options, Report, sweep_lr, train_settings
from .figures import fmt, pyplot, save, table
from .grid import Run
from .results import group, mean_std

STEPS = 600
MODES = {"blockwise": "mla-qknorm", "unified": "mla-qknorm-unified"}


def plan(options: Options) -> list[Run]:
    lr, source = sweep_lr(options)
    return [Run(f"{mode}_s{seed}", mode, train_settings(options.quick, STEPS, attn=attn, lr=lr, seed=seed),
                {"optimizer": "adamw", "lr": lr, "lr_source": source, "seed": seed})
            for seed in options.seed_list(3) for mode, attn in MODES.items()]


def report(rows: list[dict], options: Options) -> Report:
    summary = {}
    for (mode,), rs in group(rows, "variant").items():
        loss, std = mean_std(r["final_val_loss"] for r in rs)
        step, step_std = mean_std(r["median_step_seconds"] for r in rs)
        summary[mode] = {"lr": rs[0]["lr"], "seeds": len(rs), "final_val_loss": loss, "final_val_loss_std": std,
                         "step_ms": step * 1e3 if step is not None else None,
                         "step_ms_std": step_std * 1e3 if step_std is not None else None,
                         "peak_max_logit": max(r["peak_max_logit"] for r in rs)}
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(summary)
    axes[0].bar(names, [summary[n]["final_val_loss"] for n in names],
                yerr=[summary[n]["final_val_loss_std"] for n in names], capsize=4)
    axes[0].set_ylim(min(summary[n]["final_val_loss"] for n in names) * 0.98, None)
    axes[0].set_title("final validation loss (mean, std over seeds)")
    axes[1].bar(names, [summary[n]["step_ms"] for n in names], yerr=[summary[n]["step_ms_std"] for n in names],
                capsize=4)
    axes[1].set_title("median training step (ms), one thread per run")
    figures = [save(fig, options.out / "norm_mode.png")]
    header = ["mode", "lr", "final val loss (mean ± std)", "median step ms (mean ± std over runs)", "peak max logit"]
    lines = [[n, f"{s['lr']:g}", f"{fmt(s['final_val_loss'])} ± {fmt(s['final_val_loss_std'])}",
              f"{fmt(s['step_ms'], '.2f')} ± {fmt(s['step_ms_std'], '.2f')}", fmt(s["peak_max_logit"], ".2f")]
             for n, s in summary.items()]
    return Report(summary, table(header, lines), figures)


EXPERIMENT = Experiment("norm-mode", "blockwise vs unified QK RMSNorm on MLA: loss and step time", plan, report,
                        reads_sweep=True)
