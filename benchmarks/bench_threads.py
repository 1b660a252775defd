"""Training on a shared machine: one thread per core against ``--threads auto``, with and without
another process holding a core.

    python -m benchmarks.bench_threads [--steps 60] [--preset cpu] [--out FILE.json] [--overwrite]

Each cell is a fresh ``qkmla train`` process (its own run directory, the same seed and steps);
the time is the run's own ``seconds`` from status.json (the training loop, without start-up).
"held" cells start a busy loop (one Python process spinning) first and stop it after.
``threads`` is what the run used (torch's count per core, or what auto chose, from its
stderr line). The one-minute load average is recorded at every cell's end: the machine may
be shared with other work, so compare the cells of one run with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .common import start_record

SPIN = "import time\nwhile True:\n    pass\n"


def cell(preset: str, steps: int, threads: str, held: bool, work: Path) -> dict:
    """One training run in a fresh process; returns its row."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if held else None
    try:
        out = work / f"{threads}-{'held' if held else 'free'}"
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        r = subprocess.run([sys.executable, "-m", "qkmla", "train", "--preset", preset, "--steps", str(steps),
                            "--eval-interval", str(steps), "--eval-iters", "1", "--no-progress", "--threads", threads,
                            "--out", str(out)], capture_output=True, text=True, env=env, timeout=3600)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    if r.returncode != 0:
        raise RuntimeError(f"qkmla train failed ({threads}, held={held}): {r.stderr[-2000:]}")
    status = json.loads((out / "status.json").read_text())
    chose = re.search(r"qkmla train: (\d+) thread", r.stderr)
    used = int(threads) if threads != "auto" else int(chose.group(1)) if chose else os.cpu_count()
    return {"threads_option": threads, "threads": used, "another_process_holds_a_core": held,
            "seconds": round(status["seconds"], 2), "seconds_per_step": round(status["seconds"] / steps, 4),
            "load_average_1min_at_end": round(os.getloadavg()[0], 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="cpu")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps: expected a positive int, got {args.steps}")
    result, write = start_record(p, args, __spec__.name, argv, preset=args.preset, steps=args.steps)
    cores = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
    with tempfile.TemporaryDirectory() as work:
        rows = [cell(args.preset, args.steps, threads, held, Path(work))
                for held in (False, True) for threads in (cores, "auto")]
    for r in rows:
        print(f"{'held' if r['another_process_holds_a_core'] else 'free'}  --threads {r['threads_option']:>4} "
              f"({r['threads']} used)  {r['seconds']:8.2f} s  load {r['load_average_1min_at_end']}")
    result["rows"] = rows
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
