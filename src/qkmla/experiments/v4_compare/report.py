"""The report of ``v4-compare``, from the results rows alone: the brackets and chosen rates, each
arm's means over the main seeds, the pre-registered paired tests (computed only once every main
seed of every arm is in: fixed n, no interim tests), the widths that make the arms equal, and a
figure."""

from __future__ import annotations

import statistics

from ..base import Options, Report
from ..figures import curves_by_seed, fmt, table
from ..results import family_table, paired_family
from .design import ARMS, CACHE_VALUES_PER_TOKEN, PAIRS, PARAMS, QUICK, SEEDS, STEPS, TUNING_SEEDS

METRICS = (("test_loss", "test loss"), ("val_loss_all", "validation loss"),
           ("heldout_loss_pooled", "loss, all four held-out plays"), ("test_accuracy", "next-char accuracy"),
           ("max_logit_late", "late max logit"), ("peak_max_logit", "peak max logit"))


def _main(rows: list[dict]) -> dict:
    """{arm: {seed: row}} of the measured main runs."""
    out: dict = {}
    for r in rows:
        if r.get("stage") == "main" and r.get("val_loss_all") is not None:
            out.setdefault(r["variant"], {})[r["seed"]] = r
    return out


def _brackets(rows: list[dict]) -> dict:
    """{arm: {lr: {seed: val_loss_all}}} of the bracket runs (None for one not scored)."""
    out: dict = {}
    for r in rows:
        if r.get("stage") == "bracket":
            out.setdefault(r["variant"], {}).setdefault(f"{r['lr']:g}", {})[r["seed"]] = r.get("val_loss_all")
    return out


def _chosen(brackets: dict, tuning_seeds) -> dict:
    """Each arm's rate with the lowest mean validation loss over the tuning seeds (every one scored)."""
    out = {}
    for arm, by_lr in brackets.items():
        means = {lr: statistics.fmean(v[s] for s in tuning_seeds) for lr, v in by_lr.items()
                 if all(v.get(s) is not None for s in tuning_seeds)}
        if means and len(means) == len(by_lr):
            out[arm] = float(min(means, key=means.get))
    return out


def report(rows: list[dict], options: Options) -> Report:
    seeds = QUICK["seeds"] if options.quick else SEEDS
    tuning = QUICK["tuning_seeds"] if options.quick else TUNING_SEEDS
    main = _main(rows)
    loss = "val_loss_all" if options.quick else "test_loss"  # --quick trains on tiny_shakespeare: no test plays
    brackets = _brackets(rows)
    summary: dict = {"protocol": "docs/results.md, v4-compare (committed before any run)", "steps": STEPS,
                     "arms": {a: {"attn": attn, "model_overrides": o} for a, (attn, o) in ARMS.items()},
                     "cache_values_per_token_and_layer": CACHE_VALUES_PER_TOKEN, "params": PARAMS,
                     "tuning_seeds": list(tuning), "seeds": list(seeds), "brackets": brackets,
                     "chosen_lr": _chosen(brackets, tuning)}
    summary["measured"] = {a: {k: sorted({r.get(k) for r in by.values()}, key=str)
                               for k in ("params", "cache_bytes_per_token")} for a, by in sorted(main.items())}
    summary["means"] = {a: {"seeds": len(by), **{k: statistics.fmean(r[k] for r in by.values()) for k, _ in METRICS
                                                 if all(r.get(k) is not None for r in by.values())}}
                        for a, by in sorted(main.items())}
    summary["primary"] = {"metric": loss, **paired_family(main, PAIRS, loss, seeds)}
    secondary = ("val_accuracy",) if options.quick else ("val_loss_all", "heldout_loss_pooled", "test_accuracy")
    summary["secondary"] = {k: paired_family(main, PAIRS, k, seeds) for k in secondary}
    summary["runs_finished"] = sum(r["status"] == "done" for r in rows)
    return Report(summary, _tables(summary), _figures(main, options))


def _tables(s: dict) -> str:
    text = (f"v4-compare at {s['steps']} steps; every arm caches {s['cache_values_per_token_and_layer']} values per "
            f"token and layer; tuning seeds {s['tuning_seeds']}, main seeds {s['seeds'][0]}-{s['seeds'][-1]}; "
            f"protocol: {s['protocol']}.\n\n")
    lines = [[a, lr, *(fmt(v.get(seed)) for seed in s["tuning_seeds"]),
              "chosen" if s["chosen_lr"].get(a) == float(lr) else ""]
             for a, by in s["brackets"].items() for lr, v in sorted(by.items(), key=lambda kv: float(kv[0]))]
    if lines:
        text += "Rate bracket (validation loss, tuning seeds):\n\n" + table(
            ["arm", "lr", *(f"seed {x}" for x in s["tuning_seeds"]), ""], lines) + "\n"
    if s["means"]:
        text += "Means over the main seeds:\n\n" + table(
            ["arm", "seeds", "params", "cache bytes per token"] + [name for _, name in METRICS],
            [[a, m["seeds"], ", ".join(map(str, s["measured"][a]["params"])),
              ", ".join(map(str, s["measured"][a]["cache_bytes_per_token"]))] + [fmt(m.get(k)) for k, _ in METRICS]
             for a, m in s["means"].items()]
        ) + "\n"
    text += (f"Primary ({s['primary']['metric']}, Holm over the three pairs):\n\n" + family_table(s["primary"]) + "\n")
    for name, fam in s["secondary"].items():
        text += f"Secondary, {name}:\n\n" + family_table(fam) + "\n"
    return text


def _figures(main: dict, options: Options) -> list:
    return [curves_by_seed(main, ARMS, "main seeds", options.out / "curves.png")]
