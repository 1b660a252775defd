"""``qk-clip``: QK-normed MLA against QK-Clip MLA and plain MLA, each at its own best
learning rate from ``lr-sweep``, in longer runs with several seeds (the seed paper's Fig. 1
and Appendix C/D, at small scale, with Muon as the paper and MuonClip use).

Questions: does QK-norm's max logit plateau (the late-training max logit against the
mid-training one), does QK-Clip hold tau (its max logit measured after each clip, the
training forwards' max logit, and how often it clips), and what do the losses and gradient
norms do.
"""

from __future__ import annotations

from pathlib import Path

from .base import Experiment, Options, Report, sweep_best_lr, train_settings
from .figures import fmt, pyplot, save, table
from .grid import Run
from .lr_sweep import TIGHT_TAU, VARIANTS
from .results import curve, group, mean_std, values
from ..train.plot import read_metrics
from ..utils.files import input_file_problem

OPTIMIZER = "muon"
STEPS = 1200
COMPARED = ("mla", "mla-qkclip-100", f"mla-qkclip-{TIGHT_TAU:g}", "mla-qknorm")
CURVE_EVERY = 10  # steps between the points of the stored curves


def _lrs(options: Options) -> dict[str, float]:
    path = options.sweep_results
    problem = input_file_problem(path)
    if problem is not None and problem != "does not exist":  # a FIFO, a directory, a link to nothing
        raise ValueError(f"sweep: the lr-sweep results {path} {problem}")
    if problem is not None:
        raise ValueError(f"sweep: needs the lr-sweep results for each variant's best learning rate, and {path} "
                         f"does not exist: run `qkmla experiment lr-sweep{' --quick' if options.quick else ''} "
                         f"--out {Path(path).parent}` first, or pass --sweep FILE")
    return {v: sweep_best_lr(path, v, OPTIMIZER, options.sweep is not None) for v in COMPARED}


def plan(options: Options) -> list[Run]:
    lrs = _lrs(options)
    runs = []
    for variant in COMPARED:
        for seed in options.seed_list(3):
            train = train_settings(options.quick, STEPS, optimizer=OPTIMIZER, lr=lrs[variant], seed=seed,
                                   **VARIANTS[variant][0])
            runs.append(Run(f"{variant}_s{seed}", variant, train,
                            {"optimizer": OPTIMIZER, "lr": lrs[variant], "seed": seed}))
    return runs


def measure(path: Path) -> dict:
    """The max-logit (of the training forwards, and measured after each clip), gradient-norm
    and loss curves, thinned."""
    rows = read_metrics(path)
    out = {"curves": {k: curve(rows, k, CURVE_EVERY) for k in ("max_logit", "grad_norm", "loss")}}
    out["curves"]["val_loss"] = curve(rows, "val_loss", 1)
    if any("max_logit_after_clip" in r for r in rows):
        out["curves"]["max_logit_after_clip"] = curve(rows, "max_logit_after_clip", CURVE_EVERY)
    n = len(rows)
    mid = values(rows[int(0.4 * n):int(0.5 * n)], "max_logit")
    late = values(rows[int(0.9 * n):], "max_logit")
    if mid and late:  # a plateau keeps the late max logit near the mid-training one
        out["max_logit_mid"] = sum(mid) / len(mid)
        out["max_logit_late"] = sum(late) / len(late)
    return out


def report(rows: list[dict], options: Options) -> Report:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    summary = {}
    for i, ((variant,), rs) in enumerate(group(rows, "variant").items()):
        color = f"C{i}"
        for j, r in enumerate(rs):
            c = r.get("curves", {})
            label = variant if j == 0 else None
            if c.get("val_loss"):
                axes[0].plot(*zip(*c["val_loss"]), "o-", color=color, ms=2, lw=0.8, label=label)
            if c.get("max_logit"):
                axes[1].plot(*zip(*c["max_logit"]), color=color, lw=0.7, alpha=0.8, label=label)
            if c.get("max_logit_after_clip"):
                axes[1].plot(*zip(*c["max_logit_after_clip"]), color=color, lw=0.7, ls=":", alpha=0.8)
            if c.get("grad_norm"):
                axes[2].plot(*zip(*c["grad_norm"]), color=color, lw=0.6, alpha=0.7, label=label)
        loss, loss_std = mean_std(r["final_val_loss"] for r in rs)
        summary[variant] = {
            "lr": rs[0]["lr"], "seeds": len(rs), "final_val_loss": loss, "final_val_loss_std": loss_std,
            "peak_max_logit": max((r["peak_max_logit"] for r in rs if r["peak_max_logit"] is not None), default=None),
            "max_logit_mid": mean_std(r.get("max_logit_mid") for r in rs)[0],
            "max_logit_late": mean_std(r.get("max_logit_late") for r in rs)[0],
            "peak_max_logit_after_clip": max((r["peak_max_logit_after_clip"] for r in rs
                                              if r.get("peak_max_logit_after_clip") is not None), default=None),
            "clipped_step_fraction": mean_std(r["clipped_steps"] / r["steps"] for r in rs
                                              if r["clipped_steps"] is not None)[0],
            "diverged": [r["nan_step"] for r in rs if r["nan_step"] is not None],
        }
    for ax, title in zip(axes, ("validation loss", "max attention logit (dotted: measured after QK-Clip)",
                                "gradient norm (before clipping)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    figures = [save(fig, options.out / "qk_clip.png")]
    header = ["variant", "lr", "final val loss (mean ± std)", "max logit, steps 40-50%", "max logit, last 10%",
              "peak max logit", "peak measured after a clip", "steps clipped", "diverged"]
    lines = [[v, f"{s['lr']:g}", f"{fmt(s['final_val_loss'])} ± {fmt(s['final_val_loss_std'])}",
              fmt(s["max_logit_mid"], ".1f"), fmt(s["max_logit_late"], ".1f"), fmt(s["peak_max_logit"], ".1f"),
              fmt(s["peak_max_logit_after_clip"], ".1f"), fmt(s["clipped_step_fraction"], ".1%"),
              len(s["diverged"])] for v, s in summary.items()]
    return Report(summary, table(header, lines), figures)


EXPERIMENT = Experiment("qk-clip", "QK-norm vs QK-Clip vs plain MLA at each one's best lr: max logit, grad norm",
                        plan, report, measure, reads_sweep=True)
