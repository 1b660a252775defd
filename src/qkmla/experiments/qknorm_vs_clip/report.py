"""The report of ``qknorm-vs-clip`` (see its module): the bracket, the main comparison
with paired differences, the stress test, and three figures, from the results rows alone."""

from __future__ import annotations

import statistics
from typing import Optional

from ..base import Options, Report
from ..figures import fmt, pyplot, save, table
from .design import (BATCH, CONTEXT, MAX_EXTENSIONS, METRICS, PAIRS, QUICK_BRACKET, QUICK_STEPS, SEEDS,
                             SPIKE_NATS, SPIKE_WINDOW, STEPS, STRESS, TRANSIENT, VARIANTS, _paired, _score,
                             choose_rate)


def _rows_by(rows: list[dict], stage: Optional[str] = None) -> list[dict]:
    return [r for r in rows if stage is None or r.get("stage") == stage]


def _chosen_from_rows(rows: list[dict], quick: bool) -> dict[str, float]:
    """Each variant's chosen rate, as the plan settles it, from the results rows of its
    seed-0 bracket; a variant whose bracket is still running has none."""
    out = {}
    for variant in VARIANTS:
        bracket = [r for r in rows if r["variant"] == variant and r.get("stage") == "bracket"]
        first = QUICK_BRACKET if quick else VARIANTS[variant][1]
        finished = lambda r: r.get("val_loss_all") is not None or r["status"] == "non-finite"  # noqa: E731
        losses = {r["lr"]: (_score(r) if finished(r) else None) for r in bracket}
        lr, _ = choose_rate(losses, (0 if quick else MAX_EXTENSIONS) - (len(losses) - len(first)))
        if lr is not None:
            out[variant] = lr
    return out


def _mean_or_none(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def report(rows: list[dict], options: Options) -> Report:
    chosen = _chosen_from_rows(rows, options.quick)
    summary: dict = {"design": _design(rows, options), "chosen_lr": chosen}
    summary["tau_transient"] = next((r["tau"] for r in rows if r["variant"] == TRANSIENT), None)
    summary["brackets"] = {v: {f"{r['lr']:g}": r.get("val_loss_all") if r["status"] == "done" else None
                               for r in sorted(_rows_by(rows, "bracket"), key=lambda r: r["lr"]) if r["variant"] == v}
                           for v in VARIANTS}
    main: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r.get("lr_multiple") is None and chosen.get(r["variant"]) == r["lr"] and r.get("test_loss") is not None:
            main.setdefault(r["variant"], {})[r["seed"]] = r
    summary["main"] = {v: {"lr": chosen[v], "seeds": sorted(ms),
                           **{k: statistics.fmean(m[k] for m in ms.values() if m.get(k) is not None)
                              for k, _ in METRICS + (("peak_max_logit", ""), ("max_logit_late", ""))
                              if any(m.get(k) is not None for m in ms.values())},
                           "clipped_steps": [0 if ms[s].get("same_as") else ms[s].get("clipped_steps")
                                             for s in sorted(ms)],
                           # the mean over seeds of each run's peak, as every other column here; and the maximum
                           "peak_max_logit_after_clip": _mean_or_none(m.get("peak_max_logit_after_clip")
                                                                      for m in ms.values()),
                           "peak_max_logit_after_clip_max": max((m["peak_max_logit_after_clip"] for m in ms.values()
                                                                 if m.get("peak_max_logit_after_clip") is not None),
                                                                default=None),
                           "same_as": {s: ms[s].get("same_as") for s in sorted(ms) if ms[s].get("same_as")}}
                       for v, ms in main.items()}
    summary["paired"] = {f"{a} - {b}": {k: _paired(main.get(a, {}), main.get(b, {}), k) for k, _ in METRICS}
                         for a, b in PAIRS}
    stress = [r for r in rows if r.get("lr_multiple")]
    summary["stress"] = [{k: r.get(k) for k in ("variant", "lr_multiple", "lr", "status", "nan_step", "spikes",
                                                 "peak_max_logit", "peak_grad_norm", "val_loss_all", "test_loss",
                                                 "clipped_steps", "same_as")} for r in stress]
    figures = _figures(rows, main, stress, chosen, options)
    return Report(summary, _tables(summary), figures)


def _design(rows: list[dict], options: Options) -> dict:
    params = next((r["params"] for r in rows if r.get("params")), None)
    steps, per_step = (QUICK_STEPS, 4 * 16) if options.quick else (STEPS, BATCH * CONTEXT)
    return {"steps": steps, "tokens_per_step": per_step, "tokens": steps * per_step, "params": params,
            "tokens_per_param": steps * per_step / params if params else None, "seeds": list(SEEDS),
            "schedule": "wsd: warmup 5%, constant, 1 - sqrt decay to 0 over the last 20%",
            "stress_multiples": list(STRESS), "spike": f"loss > median of the previous {SPIKE_WINDOW} steps + "
                                                       f"{SPIKE_NATS} nats"}


def _tables(s: dict) -> str:
    d = s["design"]
    text = (f"Design: {d['steps']} steps of {d['tokens_per_step']} tokens ({d['tokens']:,} tokens), "
            f"{d['params'] or 0:,} parameters, {fmt(d['tokens_per_param'], '.2f')} tokens per parameter; "
            f"transient tau {fmt(s['tau_transient'], 'g')}.\n\n")
    rates = sorted({lr for b in s["brackets"].values() for lr in b}, key=float)
    text += "Learning-rate bracket (seed 0, loss over every validation window; * chosen):\n\n" + table(
        ["variant"] + [f"lr {lr}" for lr in rates],
        [[v] + [(fmt(b.get(lr)) + ("*" if s["chosen_lr"].get(v) == float(lr) else "")) if lr in b else ""
                for lr in rates] for v, b in s["brackets"].items() if b])
    header = ["variant", "lr", "seeds"] + [name for _, name in METRICS] + [
        "peak max logit", "peak after clip, mean (max)", "steps clipped"]
    lines = [[v, f"{m['lr']:g}", len(m["seeds"])] + [fmt(m.get(k)) for k, _ in METRICS] +
             [fmt(m.get("peak_max_logit"), ".1f"), _after_clip(m), _clipped(m["clipped_steps"])]
             for v, m in s["main"].items()]
    text += "\nAt each variant's chosen rate (means over seeds):\n\n" + table(header, lines)
    plines = []
    for pair, by in s["paired"].items():
        for k, name in METRICS:
            p = by.get(k)
            if p:
                plines.append([pair, name, p["n"], f"{p['mean']:+.4f}", fmt(p["se"]),
                               f"{p['negative']} / {p['positive']}", fmt(p["detectable"])])
    text += "\nPaired differences (a - b, per seed; mean, standard error, seeds below / above zero, smallest " \
            "difference detectable with 80% power):\n\n" + table(
                ["a - b", "metric", "seeds", "mean", "se", "- / +", "detectable"], plines)
    slines = [[r["variant"], f"{r['lr_multiple']}x", f"{r['lr']:g}", r["status"], r["nan_step"] or "–", r["spikes"],
               fmt(r["peak_max_logit"], ".1f"), fmt(r["peak_grad_norm"], ".2f"), fmt(r["val_loss_all"])]
              for r in s["stress"]]
    text += "\nStress test (seed 0, gradient clipping off):\n\n" + table(
        ["variant", "multiple", "lr", "status", "non-finite at step", "loss spikes", "peak max logit",
         "peak grad norm", "val loss"], slines)
    return text


def _after_clip(m: dict) -> str:
    if m.get("peak_max_logit_after_clip") is None:
        return "–"
    return f"{m['peak_max_logit_after_clip']:.1f} ({m['peak_max_logit_after_clip_max']:.1f})"


def _clipped(counts: list) -> str:
    return ", ".join("–" if c is None else str(c) for c in counts)


def _figures(rows, main, stress, chosen, options) -> list:
    plt = pyplot()
    colors = {v: f"C{i}" for i, v in enumerate(VARIANTS)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for v, by_seed in main.items():
        for seed, r in sorted(by_seed.items()):
            c = r.get("curves", {})
            kw = dict(color=colors[v], lw=1.0 if seed == SEEDS[0] else 0.6, alpha=1.0 if seed == SEEDS[0] else 0.45,
                      label=f"{v} ({chosen[v]:g})" if seed == SEEDS[0] else None)
            if c.get("val_loss"):
                axes[0].plot(*zip(*c["val_loss"]), marker="o", ms=2, **kw)
            if c.get("max_logit"):
                axes[1].plot(*zip(*c["max_logit"]), **kw)
            if c.get("grad_norm"):
                axes[2].plot(*zip(*c["grad_norm"]), **kw)
    _finish_curves(axes, ("validation loss (held-out plays, fixed windows)", "max attention logit",
                          "gradient norm (before clipping)"), legend_size=7)
    figures = [save(fig, options.out / "curves.png")]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in VARIANTS:
        pts = sorted((r["lr"], r["val_loss_all"]) for r in rows if r["variant"] == v and r.get("stage") == "bracket"
                     and r.get("val_loss_all") is not None)
        if pts:
            ax.plot(*zip(*pts), marker="o", color=colors[v], label=v)
    ax.set_xscale("log")
    ax.set_xlabel("peak learning rate (Muon)")
    ax.set_title("seed 0: loss over every validation window")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    figures.append(save(fig, options.out / "brackets.png"))

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for r in stress:
        c = r.get("curves", {})
        kw = dict(color=colors[r["variant"]], lw=0.8, ls="-" if r["lr_multiple"] == STRESS[-1] else "--",
                  label=f"{r['variant']} {r['lr_multiple']}x")
        for ax, key in zip(axes, ("loss", "max_logit", "grad_norm")):
            if c.get(key):
                ax.plot(*zip(*c[key]), **kw)
    _finish_curves(axes, ("stress test: training loss", "stress test: max attention logit",
                          "stress test: gradient norm (no clipping)"), legend_size=6)
    figures.append(save(fig, options.out / "stress.png"))
    return figures


def _finish_curves(axes, titles, legend_size: int) -> None:
    """Titles, step axes, grids and legends of a loss / max-logit / grad-norm row (the last two log-scaled)."""
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=legend_size)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
