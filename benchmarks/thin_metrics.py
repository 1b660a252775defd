"""Thin the committed per-step metrics (``runs/*/metrics.jsonl`` of the experiments under
``benchmarks/results/experiments/``, and the demo's) so that every committed results row and
summary still recomputes from them; the full files stay in git history and come back with
``--restore``.

    python -m benchmarks.thin_metrics [--dry-run]    # thin; a file whose checks fail is left as it is
    python -m benchmarks.thin_metrics --restore      # the full files back (a clone with full history)

A thinned file keeps, of each row, the fields qkmla reads (``summarize``, the experiments'
``measure`` and ``plan``, ``qkmla demo``): ``KEEP``. Whole rows: row index i % EVERY == 0,
the last row, every evaluation row (val_loss, logit_bound, logit_scale), every row with a
non-finite value, the first row holding the maximum of each of ``ARGMAX``, and rows chosen so
that the median step_seconds of the kept rows is the full series' (results.jsonl's
``median_step_seconds``). In a DENSE experiment (qknorm-vs-clip: its measure counts loss spikes
over every step, averages the last 10% of max logits and counts clipped steps; its plan takes
the transient tau from every max logit) every other row stays too, as ``DENSE_KEEP``, and
EVERY is its ``CURVE_EVERY``, so the rows with grad_norm and lr are the points of its curves.

Before a file is replaced, every value qkmla derives from it (``derived``) is computed from the
full and the thinned rows; a file where any differs is refused and left as it is. Each
directory gets a manifest, ``metrics_thinning.json``: per file its original git blob id, bytes,
rows and median step time, and the thinned blob. ``--restore`` writes every original back
(``git cat-file blob ID``, checked by hash) and removes the manifests; a second thinning
skips a file whose blob is the recorded thinned one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
from pathlib import Path

from qkmla.experiments.qknorm_vs_clip.design import CURVE_EVERY, SPIKE_NATS, SPIKE_WINDOW
from qkmla.experiments.results import curve, spikes, values
from qkmla.utils.files import write_text

from .common import ROOT

KEEP = ("step", "loss", "lr", "grad_norm", "max_logit", "step_seconds", "clipped_heads", "max_logit_after_clip",
        "val_loss", "logit_bound", "logit_scale", "non_finite")
DROPPED = ("max_logit_per_layer", "max_logit_per_head", "tokens_per_s", "max_logit_seconds",
           "max_logit_after_clip_per_layer", "after_clip_seconds")  # written by the trainer, read by nothing
DENSE_KEEP = ("step", "loss", "max_logit", "clipped_heads", "max_logit_after_clip", "non_finite")
EVAL = ("val_loss", "logit_bound", "logit_scale")
ARGMAX = ("loss", "max_logit", "grad_norm", "max_logit_after_clip")
ORIGINAL = ("loss", "lr", "grad_norm", "max_logit", "step_seconds")  # on every row the trainer writes
EVERY = 10
DENSE = ("qknorm-vs-clip",)
MANIFEST = "metrics_thinning.json"


def blob_id(data: bytes) -> str:
    """git's object id of a blob with this content (``git hash-object``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def read(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def dump(rows: list[dict]) -> bytes:
    """As the trainer writes them: one ``json.dumps(row)`` a line."""
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def median_seconds(rows: list[dict]):
    return statistics.median(values(rows, "step_seconds")) if rows else None


def derived(rows: list[dict], dense: bool) -> dict:
    """What qkmla computes from a metrics file. ``summarize`` (every experiment): the validation
    losses, the last logit bound and scale, the peak max logit (also ``qkmla demo``'s), the peak
    after a clip, whether the run clips and how many steps did, the median step time; ``qkmla
    demo``: the last row's max logit; the peak gradient norm. Dense (qknorm-vs-clip's ``measure``
    and ``plan``): loss spikes, the curves it stores, the mean max logit of the last 10% of rows,
    the first and last clipped step and the clipped fraction of the last 20%."""
    clip_run = any("clipped_heads" in r for r in rows)
    clipped = [r["step"] for r in rows if r.get("clipped_heads", 0) > 0]
    out = {"val_loss": [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r],
           "last": {k: r[k] for r in rows for k in ("logit_bound", "logit_scale") if k in r},
           "peak_max_logit": max(values(rows, "max_logit"), default=None),
           "peak_after_clip": max(values(rows, "max_logit_after_clip"), default=None),
           "clipped_steps": len(clipped) if clip_run else None,
           "last_row": (rows[-1]["step"], rows[-1].get("max_logit")) if rows else None,
           "peak_grad_norm": max(values(rows, "grad_norm"), default=None),
           "median_step_seconds": median_seconds(rows)}
    if dense:
        logits = values(rows, "max_logit")
        tail = [r for r in rows if r["step"] > 0.8 * len(rows)]
        out.update(spikes=spikes([(r["step"], r["loss"]) for r in rows if r.get("loss") is not None],
                                 SPIKE_WINDOW, SPIKE_NATS),
                   curves=[curve(rows, k, CURVE_EVERY) for k in ("loss", "max_logit")]
                   + [curve(rows, k, 1) for k in ("max_logit_after_clip",)],
                   max_logit_late=statistics.fmean(logits[int(0.9 * len(logits)):]) if logits else None,
                   rows=len(rows), clipped=(clipped[:1], clipped[-1:]),
                   clipped_last_20pct=sum(r.get("clipped_heads", 0) > 0 for r in tail))
    return out


def median_rows(rows: list[dict], whole: set) -> set:
    """Rows to keep whole as well so that the median step_seconds of the kept rows is the full
    series' median: the middle row(s) of the sorted series, then rows from the side with fewer
    kept rows (evenly spaced in step order) until as many kept rows lie below it as above."""
    order = [i for _, i in sorted((r["step_seconds"], i) for i, r in enumerate(rows)
                                  if r.get("step_seconds") is not None)]
    if not order:
        return set()
    lo, hi = (len(order) - 1) // 2, len(order) // 2
    below, above = order[:lo], order[hi + 1:]
    need = sum(i in whole for i in above) - sum(i in whole for i in below)
    short = below if need > 0 else above
    spare = sorted(i for i in short if i not in whole)
    need = abs(need)
    picked = {spare[round(j * (len(spare) - 1) / max(1, need - 1))] for j in range(need)} if need > 1 else (
        {spare[len(spare) // 2]} if need else set())
    return {order[lo], order[hi]} | picked


def thin(rows: list[dict], dense: bool) -> list[dict]:
    every = CURVE_EVERY if dense else EVERY
    whole = set(range(0, len(rows), every)) | ({len(rows) - 1} if rows else set())
    whole |= {i for i, r in enumerate(rows) if any(k in r for k in EVAL) or "non_finite" in r
              or any(r.get(k) is None for k in ORIGINAL)}
    for key in ARGMAX:
        points = [(r[key], -i) for i, r in enumerate(rows) if r.get(key) is not None]
        if points:
            whole.add(-max(points)[1])  # the first row holding the maximum
    whole |= median_rows(rows, whole)
    return [{k: v for k, v in r.items() if k in (KEEP if i in whole else DENSE_KEEP)}
            for i, r in enumerate(rows) if i in whole or dense]


def refused(full: list[dict], thinned: list[dict], dense: bool) -> list[str]:
    """What would change from the full rows to the thinned ones (nothing, or the file is refused)."""
    a, b = derived(full, dense), derived(thinned, dense)
    bad = [k for k in a if a[k] != b[k]]
    if dense:  # the grad_norm and lr curves' points are thinned rows, with their values
        kept = {r["step"]: r for r in thinned}
        bad += [f"curve {key}" for key in ("grad_norm", "lr")
                if any(kept.get(step, {}).get(key) != v for step, v in curve(full, key, CURVE_EVERY))]
    return bad


def self_thinned() -> set[str]:
    """Experiments whose runs are archived thinned already (``Experiment.thin_metrics``): left alone here."""
    from qkmla.experiments import EXPERIMENTS

    return {name for name, e in EXPERIMENTS.items() if e.thin_metrics is not None}


def targets(root: Path) -> dict[Path, list[Path]]:
    """{the directory holding a manifest: its metrics files}."""
    results = root / "benchmarks" / "results"
    skip = self_thinned()
    found = {exp: sorted(exp.glob("runs/*/metrics.jsonl")) for exp in sorted((results / "experiments").glob("*"))
             if exp.name not in skip}
    found[results / "demo"] = sorted((results / "demo").glob("*/metrics.jsonl"))
    return {where: files for where, files in found.items() if files}


def is_original(rows: list[dict]) -> bool:
    """Rows as the trainer wrote them: every step in order, each with every ``ORIGINAL`` field."""
    return bool(rows) and all(all(k in r for k in ORIGINAL) for r in rows) \
        and [r["step"] for r in rows] == list(range(rows[0]["step"], rows[0]["step"] + len(rows)))


def thin_dir(root: Path, where: Path, files: list[Path], dense: bool, dry_run: bool) -> tuple[int, int, list[str]]:
    """Thin one directory's files (the manifest written first); (bytes before, after, refused files)."""
    path = where / MANIFEST
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    entries = manifest.setdefault("files", {})
    todo, before, after, bad_files = [], 0, 0, []
    for f in files:
        rel, data = f.relative_to(root).as_posix(), f.read_bytes()
        known, rows = entries.get(rel), read(data)
        if known and blob_id(data) == known["blob"]:
            print(f"skip (already thinned): {rel}")
            continue
        if not (known and blob_id(data) == known["original_blob"]) and not is_original(rows):
            print(f"skip (not a metrics file as the trainer writes it, nor in {MANIFEST}): {rel}", file=sys.stderr)
            continue
        small = thin(rows, dense)
        bad = refused(rows, small, dense)
        if bad:
            bad_files.append(rel)
            print(f"refused {rel}: {', '.join(bad)} would change", file=sys.stderr)
            continue
        text = dump(small)
        before, after = before + len(data), after + len(text)
        entries[rel] = {"original_blob": blob_id(data), "original_bytes": len(data), "original_rows": len(rows),
                        "blob": blob_id(text), "bytes": len(text), "rows": len(small),
                        "rows_whole": sum("step_seconds" in r for r in small),
                        "median_step_seconds_full": median_seconds(rows)}
        todo.append((f, text))
    if todo and not dry_run:
        every = CURVE_EVERY if dense else EVERY
        manifest.update(
            scheme=f"whole rows (fields {', '.join(KEEP)}) at row index % {every} == 0, the last row, evaluation "
                   "rows, non-finite rows, the first row holding each maximum of " + ", ".join(ARGMAX)
                   + ", and rows that keep the median of step_seconds"
                   + (f"; every other row as {{{', '.join(DENSE_KEEP)}}}" if dense else ""),
            dropped_fields=list(DROPPED),
            restore="python -m benchmarks.thin_metrics --restore (from the repository root, a clone with full "
                    "history), or for one file: git cat-file blob ORIGINAL_BLOB > PATH")
        write_text(path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")  # first: a file is known either way
        for f, text in todo:
            write_text(f, text.decode())
    return before, after, bad_files


def restore(root: Path) -> int:
    n = 0
    for where in targets(root):
        path = where / MANIFEST
        if not path.is_file():
            continue
        for rel, entry in json.loads(path.read_text())["files"].items():
            got = subprocess.run(["git", "-C", str(root), "cat-file", "blob", entry["original_blob"]],
                                 capture_output=True)
            if got.returncode != 0 or blob_id(got.stdout) != entry["original_blob"]:
                print(f"cannot restore {rel}: git has no blob {entry['original_blob']} here (a shallow clone? "
                      f"git fetch --unshallow): {got.stderr.decode().strip()}", file=sys.stderr)
                return 1
            (root / rel).write_bytes(got.stdout)
            n += 1
        path.unlink()
    print(f"restored {n} files")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=ROOT, help="the repository (default: the one holding this file)")
    p.add_argument("--dry-run", action="store_true", help="check every file and report sizes; write nothing")
    p.add_argument("--dense", nargs="*", default=list(DENSE),
                   help=f"experiment directories kept at every step (default: {' '.join(DENSE)})")
    p.add_argument("--restore", action="store_true", help="write the full files back from git and remove the manifests")
    args = p.parse_args(argv)
    root = args.root.resolve()
    if not (root / "benchmarks" / "results").is_dir():
        p.error(f"--root: no benchmarks/results in {root}")
    if args.restore:
        return restore(root)
    before = after = 0
    bad = []
    for where, files in targets(root).items():
        b, a, refused_files = thin_dir(root, where, files, where.name in args.dense, args.dry_run)
        before, after, bad = before + b, after + a, bad + refused_files
    print(f"{'would thin' if args.dry_run else 'thinned'}: {before / 1e6:.2f} MB -> {after / 1e6:.2f} MB")
    if bad:
        print(f"{len(bad)} files refused (left as they are)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
