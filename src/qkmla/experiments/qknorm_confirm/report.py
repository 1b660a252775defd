"""The report of ``qknorm-confirm``, from the results rows alone: each arm's scores per
horizon, the pre-registered paired tests (computed only once every seed of the pairs has
reached the horizon: fixed n, no interim tests), clipping, the rate check and the
reproduction check, and a figure."""

from __future__ import annotations

import json
import statistics

from ..base import Options, Report
from ..figures import curves_by_seed, fmt, table
from ..numerics import SUPERSEDED, UNRECORDED, recorded
from ..results import family_table, paired_family
from .design import (ACCURACY_REPLICATION, ARMS, HORIZONS, LR, PRIMARY_HORIZON, PRIMARY_PAIRS, QUICK, RATE_CHECK, SEEDS,
                     all_runs)

METRICS = (("test_loss", "test loss"), ("heldout_loss_pooled", "loss, all four held-out plays"),
           ("test_accuracy", "next-char accuracy"))
# --quick trains on tiny_shakespeare, which has no test or held-out plays: its one score is the validation loss
QUICK_METRICS = (("val_loss_all", "validation loss"),)


def _main(rows: list[dict]) -> dict:
    """{horizon: {arm: {seed: row}}} of the measured main decay branches at the arms' rate."""
    out: dict = {}
    for r in rows:
        if r.get("stage") == "main" and r.get("phase") == "decay" and r.get("val_loss_all") is not None:
            out.setdefault(r["horizon"], {}).setdefault(r["variant"], {})[r["seed"]] = r
    return out


def report(rows: list[dict], options: Options) -> Report:
    seeds = QUICK["seeds"] if options.quick else SEEDS
    horizons = QUICK["horizons"] if options.quick else HORIZONS
    primary = horizons[-1] if options.quick else PRIMARY_HORIZON
    main = _main(rows)
    metrics = QUICK_METRICS if options.quick else METRICS
    summary: dict = {"protocol": "docs/results.md, qknorm-confirm (committed before any run)", "lr": LR,
                     "arms": {a: f for a, f in ARMS.items()}, "seeds": list(seeds), "horizons": list(horizons),
                     "metrics": dict(metrics)}
    summary["means"] = {str(h): {a: {"seeds": len(by), **{k: statistics.fmean(r[k] for r in by.values())
                                                          for k, _ in METRICS + (("val_loss_all", ""),)
                                                          if all(r.get(k) is not None for r in by.values())}}
                                 for a, by in sorted(main.get(h, {}).items())} for h in horizons}
    loss = metrics[0][0]
    summary["primary"] = {"metric": loss, **paired_family(main.get(primary, {}), PRIMARY_PAIRS, loss, seeds)}
    summary["secondary"] = {
        **{f"{loss} at {h}": paired_family(main.get(h, {}), PRIMARY_PAIRS, loss, seeds)
           for h in horizons if h != primary},
        **{f"{k} at {h}": paired_family(main.get(h, {}), PRIMARY_PAIRS, k, seeds)
           for h in horizons for k, _ in metrics[1:]}}
    if not options.quick:
        summary["secondary"][f"test_accuracy at {horizons[0]}, {' - '.join(ACCURACY_REPLICATION)}"] = \
            paired_family(main.get(horizons[0], {}), (ACCURACY_REPLICATION,), "test_accuracy", seeds)
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
    # Which numerics each finished run ran under (numerics.py; None: trained before runs recorded
    # them), and the runs a chain superseded for running under other numerics than the rest of it.
    summary["numerics"] = {}
    for r in rows:
        if r["status"] == "done":
            # the run's own record (a run measured before its record was written has none in its row)
            path = options.out / "runs" / r["run"]
            key = json.dumps(recorded(path) if path.is_dir() else r.get("numerics") or UNRECORDED, sort_keys=True)
            summary["numerics"][key] = summary["numerics"].get(key, 0) + 1
    summary["superseded"] = [json.loads(p.read_text())
                             for p in sorted((options.out / SUPERSEDED).glob("*/superseded.json"))]
    summary["runs_finished"] = sum(r["status"] == "done" for r in rows)
    # summary.json's "runs" is the plan when the grid last wrote it, which lists a branch only once
    # its stretch before has finished: far fewer than the grid's runs in all.
    summary["runs_in_all"] = len(all_runs(options))
    return Report(summary, _tables(summary), _figures(main, horizons, options))


def _tables(s: dict) -> str:
    text = f"qknorm-confirm at Muon lr {s['lr']:g}; seeds {s['seeds'][0]}-{s['seeds'][-1]}; protocol: {s['protocol']}.\n\n"
    metrics = s.get("metrics") or dict(METRICS)  # a summary written before the field: a full grid's
    for h, by in s["means"].items():
        text += f"Means at {h} steps:\n\n" + table(
            ["arm", "seeds"] + list(metrics.values()), [[a, m["seeds"]] + [fmt(m.get(k)) for k in metrics]
                                                        for a, m in by.items()]) + "\n"
    text += (f"Primary ({metrics[s['primary']['metric']]} at the last horizon, Holm over the three):\n\n"
             + family_table(s["primary"]) + "\n")
    for name, fam in s["secondary"].items():
        text += f"Secondary, {name}:\n\n" + family_table(fam) + "\n"
    clines = [[h, a, seed, c["clipped_steps"], c["first_clip_step"], c["last_clip_step"],
               f"{c['clipped_decay_steps']} / {c['decay_steps']}" if c.get("decay_steps") else "–"]
              for h, by in s["clipping"].items() for a, per in by.items() for seed, c in per.items()]
    if clines:
        text += "QK-Clip: when it fired:\n\n" + table(
            ["horizon", "arm", "seed", "steps clipped", "first", "last", "decay steps clipped"], clines) + "\n"
    if s["rate_check"]:
        loss = s["primary"]["metric"]
        text += f"Rate check ({metrics[loss]} at the last horizon):\n\n" + table(
            ["arm", "lr", "seed", metrics[loss]], [[r["variant"], f"{r['lr']:g}", r["seed"], fmt(r[loss])]
                                                 for r in sorted(s["rate_check"], key=lambda r: (r["variant"], r["seed"],
                                                                                                  r["lr"]))]) + "\n"
    if s["reproduction"]:
        text += "Reproduction of committed qknorm-vs-clip runs (per-step training loss):\n\n" + table(
            ["run", "committed run", "steps compared", "equal", "largest difference"],
            [[r["run"], r.get("committed_run"), r.get("steps_compared"), r.get("losses_equal"),
              fmt(r.get("max_abs_loss_difference"), ".3g")] for r in s["reproduction"]]) + "\n"
    if s["superseded"]:
        text += "Superseded (trained again under one numerics with the rest of their chain):\n\n" + table(
            ["run", "why"], [[r["run"], r["why"]] for r in s["superseded"]]) + "\n"
    return text


def _figures(main: dict, horizons, options: Options) -> list:
    return [curves_by_seed(main.get(horizons[-1], {}), ARMS, f"{horizons[-1]}-step branches",
                           options.out / "curves.png")]
