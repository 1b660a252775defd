"""One results row per run, and the aggregates every experiment's report uses.

A row (``results.jsonl``): the run's labels (variant, optimizer, lr, seed, ...), its status,
final and best validation loss, peak max logit (of the training forwards and, with QK-Clip,
the peak measured after a clip, with the number of steps that clipped),
the step of a divergence or null, the seconds it took, the median step time, the last logit
bound / learned logit scale of QK-normed layers, and anything the experiment measured.
Non-finite numbers are written as null, so the file is strict JSON. Also here: paired
differences across seeds, their paired t tests with Holm's adjustment over a family (and the
family's table), and loss spikes.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Iterable, Optional

from ..train.plot import read_metrics
from ..train.rundir import clean_json, read_status
from ..utils.files import write_text
from .figures import table
from .grid import Run, run_dir


def finite(v) -> Optional[float]:
    return float(v) if v is not None and math.isfinite(v) else None


def curve(rows: list[dict], key: str, every: int) -> list:
    """[[step, value], ...] of ``key`` at every ``every``-th logged step (and the last one)."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [list(p) for i, p in enumerate(pts) if i % every == 0 or i == len(pts) - 1]


def values(rows: list[dict], key: str) -> list[float]:
    """The numbers logged under ``key`` (null marks a non-finite value: skipped)."""
    return [r[key] for r in rows if r.get(key) is not None]


def run_curves(rows: list[dict], every: int) -> dict:
    """A run's stored curves: training loss, max logit, gradient norm and learning rate at every
    ``every``-th logged step (see :func:`curve`), and the validation loss at every evaluation."""
    out = {k: curve(rows, k, every) for k in ("loss", "max_logit", "grad_norm", "lr")}
    out["val_loss"] = curve(rows, "val_loss", 1)
    return out


def max_logit_late(rows: list[dict]) -> Optional[float]:
    """The mean max logit over the last tenth of the logged steps (None when none was logged):
    the level a run's logits settled at, beside their peak."""
    logits = values(rows, "max_logit")
    return statistics.fmean(logits[int(0.9 * len(logits)):]) if logits else None


def summarize(experiment: str, run: Run, out: Path) -> dict:
    """The results row of one run (see the module docstring). A run ``same_as`` another
    reads that run's directory and records ``same_as``."""
    path = Path(out) / "runs" / run.same_as if run.same_as else run_dir(out, run)
    status = read_status(path) or {"status": "missing"}
    rows = read_metrics(path) if (path / "metrics.jsonl").is_file() else []
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    vals = [finite(r["val_loss"]) for r in rows if "val_loss" in r]
    last = {k: r[k] for r in rows for k in ("logit_bound", "logit_scale") if k in r}
    after = values(rows, "max_logit_after_clip")
    clip_run = any("clipped_heads" in r for r in rows)
    done = status["status"] == "done"
    row = {
        "experiment": experiment, "run": run.name, "variant": run.variant, **run.labels,
        "status": status["status"], "steps": status.get("step"),
        "initial_loss": math.log(config["model"]["vocab_size"]) if config else None,
        "final_val_loss": vals[-1] if done and vals else None,
        "best_val_loss": min((v for v in vals if v is not None), default=None),
        "peak_max_logit": max(values(rows, "max_logit"), default=None),
        "peak_max_logit_after_clip": max(after) if after else None,
        "clipped_steps": sum(1 for r in rows if r.get("clipped_heads", 0) > 0) if clip_run else None,
        "nan_step": status.get("step") if status["status"] == "non-finite" else None,
        "seconds": status.get("seconds"),
        "median_step_seconds": statistics.median(values(rows, "step_seconds")) if rows else None,
        **last,
    }
    if (path / "measure.json").is_file():
        row.update(json.loads((path / "measure.json").read_text()))
    if "error" in status:
        row["error"] = status["error"]
    if run.same_as:
        row["same_as"] = run.same_as
    return clean_json(row)


def write_results(rows: list[dict], path: Path) -> None:
    """Atomically and durably (a full disk keeps the previous file whole)."""
    write_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def effective_loss(row: dict) -> float:
    """The final validation loss, or the initial loss ln(V) for a run that diverged (or ended
    above it): what the run is worth at the end, capped at knowing nothing."""
    loss = row["final_val_loss"]
    return row["initial_loss"] if loss is None else min(loss, row["initial_loss"])


def mean_std(values: Iterable[float]) -> tuple[Optional[float], Optional[float]]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def group(rows: list[dict], *keys: str) -> dict[tuple, list[dict]]:
    """Rows grouped by the values of ``keys``, in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    return groups


def best_lr(rows: list[dict], variant: str, optimizer: str) -> tuple[float, float]:
    """(lr, mean effective loss over seeds) of the variant's best learning rate in a sweep."""
    by_lr = group([r for r in rows if r["variant"] == variant and r["optimizer"] == optimizer], "lr")
    if not by_lr:
        raise ValueError(f"sweep: no runs of variant {variant!r} with optimizer {optimizer!r}")
    scored = [(statistics.fmean(map(effective_loss, rs)), lr) for (lr,), rs in by_lr.items()]
    loss, lr = min(scored)
    return lr, loss


# Student t quantiles (two-sided 5% and one-sided 20%) by degrees of freedom, for the smallest
# difference a paired design detects with 80% power at the 5% level.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
_T80 = {1: 1.376, 2: 1.061, 3: 0.978, 4: 0.941, 5: 0.920, 6: 0.906, 7: 0.896, 8: 0.889, 9: 0.883}


def paired_difference(diffs: list[float]) -> dict:
    """Mean, standard deviation and standard error of per-seed differences, how many are
    positive and negative, t, and the smallest difference detectable with 80% power at the
    two-sided 5% level given this spread and number of seeds ((t_0.975 + t_0.8) x se)."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if n > 1 else None
    se = sd / math.sqrt(n) if sd is not None else None
    df = n - 1
    mde = (_T975[df] + _T80[df]) * se if se is not None and df in _T975 else None
    return {"n": n, "diffs": diffs, "mean": mean, "sd": sd, "se": se, "t": mean / se if se else None,
            "positive": sum(d > 0 for d in diffs), "negative": sum(d < 0 for d in diffs), "detectable": mde}


def spikes(losses: list[tuple[int, float]], window: int = 50, nats: float = 0.5) -> list[int]:
    """Steps whose training loss exceeds the median of the previous ``window`` steps' by
    more than ``nats``."""
    out = []
    for i in range(window, len(losses)):
        if losses[i][1] > statistics.median(v for _, v in losses[i - window:i]) + nats:
            out.append(losses[i][0])
    return out


def loss_spikes(rows: list[dict], window: int = 50, nats: float = 0.5) -> list[int]:
    """:func:`spikes` of a run's logged training losses (a non-finite one, null, skipped)."""
    return spikes([(r["step"], r["loss"]) for r in rows if r.get("loss") is not None], window, nats)


# -- tests of paired differences ----------------------------------------------------------------

def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: int) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df: expected an int >= 1, got {df!r}")
    return _betainc(0.5 * df, 0.5, df / (df + t * t))


def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile (0.5 < q < 1) of Student's t with ``df`` degrees of freedom, by bisection."""
    if not 0.5 < q < 1.0:
        raise ValueError(f"q: expected 0.5 < q < 1, got {q!r}")
    lo, hi = 0.0, 1e4
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > 2 * (1 - q) else (lo, mid)
    return 0.5 * (lo + hi)


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm-adjusted p-values (step-down, monotone, capped at 1) of a family of tests by name."""
    order = sorted(pvalues, key=pvalues.get)
    out, running, m = {}, 0.0, len(order)
    for i, name in enumerate(order):
        running = max(running, min(1.0, (m - i) * pvalues[name]))
        out[name] = running
    return out


def paired_test(diffs: list[float], level: float = 0.95) -> dict:
    """:func:`paired_difference` with the two-sided p-value of its paired t test and the
    ``level`` confidence interval of the mean difference (n >= 2)."""
    p = paired_difference(diffs)
    if p["n"] < 2:
        raise ValueError(f"diffs: a paired test needs at least 2 differences, got {p['n']}")
    df = p["n"] - 1
    if not p["se"]:
        raise ValueError("diffs: every difference is the same; the t test is undefined")
    half = t_quantile(0.5 + level / 2, df) * p["se"]
    return {**p, "p": t_two_sided_p(p["t"], df), "ci": [p["mean"] - half, p["mean"] + half], "ci_level": level}


def paired_family(by_arm: dict, pairs, key: str, seeds) -> dict:
    """Paired tests of ``pairs`` ((a, b): a - b) on ``key`` over ``seeds`` (``by_arm``
    {arm: {seed: row}}), with Holm over the family; ``pending`` (with how many seeds are in)
    until every pair has every seed: fixed n, no interim test. Differences all the same (a
    clip that never fired, say) get no t test and stay out of the Holm family (``degenerate``)."""
    diffs = {}
    for a, b in pairs:
        ra, rb = by_arm.get(a, {}), by_arm.get(b, {})
        diffs[f"{a} - {b}"] = [ra[s][key] - rb[s][key] for s in seeds
                               if s in ra and s in rb and ra[s].get(key) is not None and rb[s].get(key) is not None]
    if any(len(d) < len(seeds) for d in diffs.values()):
        return {"status": "pending", "seeds_in": {k: len(d) for k, d in diffs.items()}, "seeds_needed": len(seeds)}
    tests = {k: paired_test(d) if len(set(d)) > 1 else {"n": len(d), "mean": d[0], "degenerate": True}
             for k, d in diffs.items()}
    for k, p in holm({k: t["p"] for k, t in tests.items() if "p" in t}).items():
        tests[k]["holm_p"] = p
    return {"status": "complete", "tests": tests}


def family_table(family: dict) -> str:
    """A :func:`paired_family` as a Markdown table (a - b, n, mean ± se, 95% interval, p, Holm p,
    seeds below / above 0), or the line saying how many seeds are in while it is pending."""
    if family["status"] != "complete":
        return (f"pending: seeds in {family['seeds_in']} of {family['seeds_needed']} "
                "(no test before all are in)\n")
    return table(["a - b", "n", "mean ± se", "95% interval", "p", "Holm p", "- / +"],
                 [[k, t["n"], f"{t['mean']:+.5f} ± {t['se']:.5f}", f"{t['ci'][0]:+.5f} to {t['ci'][1]:+.5f}",
                   f"{t['p']:.4f}", f"{t['holm_p']:.4f}", f"{t['negative']} / {t['positive']}"]
                  if "p" in t else [k, t["n"], f"{t['mean']:+.5f} on every seed", "–", "–", "–", "–"]
                  for k, t in family["tests"].items()])
