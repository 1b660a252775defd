"""``lp-sweep``: Lp QK normalization over p (seed 004), on MHA as in that paper and on MLA
(trained explicitly; its absorbed decode path is exact for every p, ``qkmla verify``).

An Lp-normalized dot product's range grows with p (for p > 2, |q.k| can reach
d^(1 - 2/p); for p < 2 it is at most 1), so at one initial logit scale a change of p is also
a change of temperature. Two controls: the logit scale is learned (one per head, as for
every -l2/-lp variant here) and reported at the end of training; and for the extreme p the
grid adds runs whose initial scale is *temperature matched*: multiplied so that the logits
of random Gaussian queries and keys have the spread they have at p = 2.
"""

from __future__ import annotations

import math

import torch

from ..model.gpt import GPT_PRESETS
from ..ops.statistic import statistic
from .base import Experiment, Options, Report, sweep_lr, train_settings
from .figures import fmt, pyplot, save, table
from .grid import Run
from .results import group, mean_std

PS = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
QUICK_PS = (1.0, 2.0, 4.0)
MATCHED_PS = (1.0, 4.0)
MODELS = ("mha-lp", "mla-lp")
STEPS = 300


def typical_logit(p: float, widths: list[int], samples: int = 4096) -> float:
    """The standard deviation of q.k over random Gaussian q, k Lp-normalized blockwise
    (one block per width), with unit norm weights and scale 1."""
    gen = torch.Generator().manual_seed(0)
    var = 0.0
    for n in widths:
        q, k = torch.randn(2, samples, n, generator=gen, dtype=torch.float64)
        dots = (q * k).sum(-1) * statistic(q, "lp", p, 0.0)[..., 0] * statistic(k, "lp", p, 0.0)[..., 0]
        var += float(dots.var())
    return math.sqrt(var)


def block_widths(attn: str, preset: str) -> list[int]:
    cfg = GPT_PRESETS[preset].replace(attn=attn).attention_config()
    return [cfg.qk_nope_head_dim, cfg.qk_rope_head_dim] if attn.startswith("mla") else [cfg.dim_per_head]


def matched_scale(attn: str, preset: str, p: float) -> float:
    """The initial logit scale at p that gives the p = 2 run's initial logit spread."""
    cfg = GPT_PRESETS[preset].replace(attn=attn, qk_norm_p=2.0).attention_config()
    widths = block_widths(attn, preset)
    return cfg.scale * typical_logit(2.0, widths) / typical_logit(p, widths)


def plan(options: Options) -> list[Run]:
    lr, source = sweep_lr(options)
    runs = []
    for seed in options.seed_list(3):
        for attn in MODELS:
            for p in QUICK_PS if options.quick else PS:
                train = train_settings(options.quick, STEPS, attn=attn, qk_norm_p=p, lr=lr, seed=seed)
                runs.append(Run(f"{attn}_p{p:g}_s{seed}", attn, train,
                                {"p": p, "matched": False, "lr": lr, "lr_source": source, "seed": seed}))
            for p in MATCHED_PS:
                train = train_settings(options.quick, STEPS, attn=attn, qk_norm_p=p, lr=lr, seed=seed)
                scale = matched_scale(attn, train["preset"], p)
                runs.append(Run(f"{attn}_p{p:g}_matched_s{seed}", attn, {**train, "softmax_scale": scale},
                                {"p": p, "matched": True, "initial_scale": scale, "lr": lr, "seed": seed}))
    return runs


def report(rows: list[dict], options: Options) -> Report:
    summary = {}
    for (attn, p, matched), rs in sorted(group(rows, "variant", "p", "matched").items()):
        loss, std = mean_std(r["final_val_loss"] for r in rs)
        scale, _ = mean_std(r.get("logit_scale") for r in rs)
        summary.setdefault(attn, []).append({"p": p, "matched": matched, "final_val_loss": loss,
                                             "final_val_loss_std": std, "learned_logit_scale": scale,
                                             "seeds": len(rs)})
    verdict = {}
    for attn, entries in summary.items():
        base = next(e for e in entries if e["p"] == 2.0 and not e["matched"])
        above = [e for e in entries if e["p"] > 2.0 and e["final_val_loss"] is not None]
        best = min(above, key=lambda e: e["final_val_loss"], default=None)
        if best is not None:
            gap = base["final_val_loss"] - best["final_val_loss"]
            noise = max(base["final_val_loss_std"], best["final_val_loss_std"])
            single = min(base["seeds"], best["seeds"]) < 2  # no spread to judge against
            verdict[attn] = {"best_p_above_2": best["p"], "best_p_above_2_matched": best["matched"],
                             "loss_p2": base["final_val_loss"], "loss_best_p_above_2": best["final_val_loss"],
                             "gain_over_p2": gap, "larger_std": noise, "beats_p2": None if single else gap > noise}
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.3))
    for i, (attn, entries) in enumerate(summary.items()):
        plain = [e for e in entries if not e["matched"]]
        matched = [e for e in entries if e["matched"]]
        axes[0].errorbar([e["p"] for e in plain], [e["final_val_loss"] for e in plain],
                         yerr=[e["final_val_loss_std"] for e in plain], fmt="o-", color=f"C{i}", capsize=3, label=attn)
        axes[0].errorbar([e["p"] for e in matched], [e["final_val_loss"] for e in matched],
                         yerr=[e["final_val_loss_std"] for e in matched], fmt="s", mfc="none", color=f"C{i}",
                         capsize=3, label=f"{attn}, temperature matched")
        axes[1].plot([e["p"] for e in plain], [e["learned_logit_scale"] for e in plain], "o-", color=f"C{i}",
                     label=attn)
        axes[1].plot([e["p"] for e in matched], [e["learned_logit_scale"] for e in matched], "s", mfc="none",
                     color=f"C{i}", label=f"{attn}, matched")
    axes[0].set_title("final validation loss (mean, std over seeds)")
    axes[1].set_title("learned logit scale at the end (mean over heads, layers, seeds)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("p")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    figures = [save(fig, options.out / "lp_sweep.png")]
    header = ["model", "p", "initial scale", "final val loss (mean ± std)", "learned logit scale"]
    lines = [[attn, f"{e['p']:g}", "matched" if e["matched"] else "default",
              f"{fmt(e['final_val_loss'])} ± {fmt(e['final_val_loss_std'])}", fmt(e["learned_logit_scale"], ".2f")]
             for attn, entries in summary.items() for e in entries]
    text = table(header, lines)
    for attn, v in verdict.items():
        text += (f"\n{attn}: best p > 2 is p = {v['best_p_above_2']:g}"
                 f"{' (temperature matched)' if v['best_p_above_2_matched'] else ''}, "
                 f"loss {v['loss_best_p_above_2']:.4f} against p = 2's {v['loss_p2']:.4f} "
                 f"(seed std up to {v['larger_std']:.4f}): "
                 + ("one seed, so no seed spread to judge it against.\n" if v["beats_p2"] is None else
                    f"{'beats' if v['beats_p2'] else 'does not beat'} p = 2 by more than the seed spread.\n"))
    return Report({"by_model": summary, "verdict": verdict}, text, figures)


EXPERIMENT = Experiment("lp-sweep", "Lp QK norm over p on MHA and MLA, with temperature-matched controls",
                        plan, report, reads_sweep=True)
