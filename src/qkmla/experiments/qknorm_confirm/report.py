"""The report of ``qknorm-confirm``, from the results rows alone: each arm's scores per
horizon, the pre-registered paired tests (computed only once every seed of the pairs has
reached the horizon: fixed n, no interim tests), clipping, the rate check and the
reproduction check, and a figure."""

from __future__ import annotations

import statistics

from ..base import Options, Report
from ..figures import fmt, pyplot, save, table
from ..results import holm, paired_test
from .design import ACCURACY_REPLICATION, ARMS, HORIZONS, LR, PRIMARY_HORIZON, PRIMARY_PAIRS, QUICK, RATE_CHECK, SEEDS

METRICS = (("test_loss", "test loss"), ("heldout_loss_pooled", "loss, all four held-out plays"),
           ("test_accuracy", "next-char accuracy"))


def _main(rows: list[dict]) -> dict:
    """{horizon: {arm: {seed: row}}} of the measured main decay branches at the arms' rate."""
    out: dict = {}
    for r in rows:
        if r.get("stage") == "main" and r.get("phase") == "decay" and r.get("val_loss_all") is not None:
            out.setdefault(r["horizon"], {}).setdefault(r["variant"], {})[r["seed"]] = r
    return out


def family(by_arm: dict, pairs, key: str, seeds) -> dict:
    """Paired tests of ``pairs`` on ``key`` with Holm over the family, or ``pending`` (with how
    many seeds are in) until every pair has every seed."""
    diffs = {}
    for a, b in pairs:
        ra, rb = by_arm.get(a, {}), by_arm.get(b, {})
        diffs[f"{a} - {b}"] = [ra[s][key] - rb[s][key] for s in seeds
                               if s in ra and s in rb and ra[s].get(key) is not None and rb[s].get(key) is not None]
    if any(len(d) < len(seeds) for d in diffs.values()):
        return {"status": "pending", "seeds_in": {k: len(d) for k, d in diffs.items()}, "seeds_needed": len(seeds)}
    # every difference the same (a clip that never fired, say): no t test; out of the Holm family
    tests = {k: paired_test(d) if len(set(d)) > 1 else {"n": len(d), "mean": d[0], "degenerate": True}
             for k, d in diffs.items()}
    for k, p in holm({k: t["p"] for k, t in tests.items() if "p" in t}).items():
        tests[k]["holm_p"] = p
    return {"status": "complete", "tests": tests}


def report(rows: list[dict], options: Options) -> Report:
    seeds = QUICK["seeds"] if options.quick else SEEDS
    horizons = QUICK["horizons"] if options.quick else HORIZONS
    primary = horizons[-1] if options.quick else PRIMARY_HORIZON
    main = _main(rows)
    summary: dict = {"protocol": "docs/results.md, qknorm-confirm (committed before any run)", "lr": LR,
                     "arms": {a: f for a, f in ARMS.items()}, "seeds": list(seeds), "horizons": list(horizons)}
    summary["means"] = {str(h): {a: {"seeds": len(by), **{k: statistics.fmean(r[k] for r in by.values())
                                                          for k, _ in METRICS + (("val_loss_all", ""),)
                                                          if all(r.get(k) is not None for r in by.values())}}
                                 for a, by in sorted(main.get(h, {}).items())} for h in horizons}
    loss = "val_loss_all" if options.quick else "test_loss"  # --quick trains on tiny_shakespeare: no test plays
    summary["primary"] = {"metric": loss, **family(main.get(primary, {}), PRIMARY_PAIRS, loss, seeds)}
    summary["secondary"] = {
        **{f"{loss} at {h}": family(main.get(h, {}), PRIMARY_PAIRS, loss, seeds)
           for h in horizons if h != primary},
        **{f"{k} at {h}": family(main.get(h, {}), PRIMARY_PAIRS, k, seeds)
           for h in horizons for k, _ in METRICS[1:]},
        f"test_accuracy at {horizons[0]}, {' - '.join(ACCURACY_REPLICATION)}":
            family(main.get(horizons[0], {}), (ACCURACY_REPLICATION,), "test_accuracy", seeds)}
    summary["clipping"] = {str(h): {a: {s: {k: r.get(k) for k in ("clipped_steps", "first_clip_step", "last_clip_step",
                                                                   "clipped_decay_steps", "decay_steps",
                                                                   "peak_max_logit", "peak_max_logit_after_clip")}
                                        for s, r in sorted(by.items())}
                                    for a, by in main.get(h, {}).items() if ARMS[a].get("qk_clip") is not None}
                           for h in horizons}
    summary["rate_check"] = [{k: r.get(k) for k in ("variant", "lr", "seed", "test_loss", "val_loss_all")}
                             for r in rows if r.get("phase") == "decay" and r.get("horizon") == primary
                             and r.get("val_loss_all") is not None and r["seed"] in RATE_CHECK["seeds"]
                             and r["variant"] in RATE_CHECK["arms"] and r.get("stage") in ("rate check", "main")]
    summary["reproduction"] = [{"run": r["run"], **(r.get("reproduction") or {})} for r in rows
                               if r.get("stage") == "reproduce" and r.get("phase") == "decay"
                               and r.get("reproduction") is not None]
    summary["runs_finished"] = sum(r["status"] == "done" for r in rows)
    return Report(summary, _tables(summary), _figures(main, horizons, options))


def _tests_table(fam: dict) -> str:
    if fam["status"] != "complete":
        return f"pending: seeds in {fam['seeds_in']} of {fam['seeds_needed']} (no test before all are in)\n"
    return table(["a - b", "n", "mean ± se", "95% interval", "p", "Holm p", "- / +"],
                 [[k, t["n"], f"{t['mean']:+.5f} ± {t['se']:.5f}", f"{t['ci'][0]:+.5f} to {t['ci'][1]:+.5f}",
                   f"{t['p']:.4f}", f"{t['holm_p']:.4f}", f"{t['negative']} / {t['positive']}"]
                  if "p" in t else [k, t["n"], f"{t['mean']:+.5f} on every seed", "–", "–", "–", "–"]
                  for k, t in fam["tests"].items()])


def _tables(s: dict) -> str:
    text = f"qknorm-confirm at Muon lr {s['lr']:g}; seeds {s['seeds'][0]}-{s['seeds'][-1]}; protocol: {s['protocol']}.\n\n"
    for h, by in s["means"].items():
        text += f"Means at {h} steps:\n\n" + table(
            ["arm", "seeds"] + [name for _, name in METRICS], [[a, m["seeds"]] + [fmt(m.get(k)) for k, _ in METRICS]
                                                               for a, m in by.items()]) + "\n"
    text += "Primary (test loss at the last horizon, Holm over the three):\n\n" + _tests_table(s["primary"]) + "\n"
    for name, fam in s["secondary"].items():
        text += f"Secondary, {name}:\n\n" + _tests_table(fam) + "\n"
    clines = [[h, a, seed, c["clipped_steps"], c["first_clip_step"], c["last_clip_step"],
               f"{c['clipped_decay_steps']} / {c['decay_steps']}" if c.get("decay_steps") else "–"]
              for h, by in s["clipping"].items() for a, per in by.items() for seed, c in per.items()]
    if clines:
        text += "QK-Clip: when it fired:\n\n" + table(
            ["horizon", "arm", "seed", "steps clipped", "first", "last", "decay steps clipped"], clines) + "\n"
    if s["rate_check"]:
        text += "Rate check (test loss at the last horizon):\n\n" + table(
            ["arm", "lr", "seed", "test loss"], [[r["variant"], f"{r['lr']:g}", r["seed"], fmt(r["test_loss"])]
                                                 for r in sorted(s["rate_check"], key=lambda r: (r["variant"], r["seed"],
                                                                                                  r["lr"]))]) + "\n"
    if s["reproduction"]:
        text += "Reproduction of committed qknorm-vs-clip runs (per-step training loss):\n\n" + table(
            ["run", "committed run", "steps compared", "equal", "largest difference"],
            [[r["run"], r.get("committed_run"), r.get("steps_compared"), r.get("losses_equal"),
              fmt(r.get("max_abs_loss_difference"), ".3g")] for r in s["reproduction"]]) + "\n"
    return text


def _figures(main: dict, horizons, options: Options) -> list:
    plt = pyplot()
    colors = {a: f"C{i}" for i, a in enumerate(ARMS)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    last = main.get(horizons[-1], {})
    for arm, by_seed in last.items():
        for i, (seed, r) in enumerate(sorted(by_seed.items())):
            c = r.get("curves", {})
            kw = dict(color=colors[arm], lw=0.7, alpha=0.8 if i == 0 else 0.35, label=arm if i == 0 else None)
            if c.get("val_loss"):
                axes[0].plot(*zip(*c["val_loss"]), **kw)
            if c.get("max_logit"):
                axes[1].plot(*zip(*c["max_logit"]), **kw)
    for ax, title in zip(axes, ("validation loss (held-out plays)", "max attention logit")):
        ax.set_title(f"{title}, {horizons[-1]}-step branches")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return [save(fig, options.out / "curves.png")]
