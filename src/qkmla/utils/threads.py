"""How many threads a long-running command uses (``--threads N``, or ``auto``, the default).

Torch's default is one thread per core. Its parallel regions end in a barrier, so one thread
that shares its core with another process makes every region wait for that thread's next
time slice: on a 2-core machine where another process held a core, 60 training steps took
114 s with 2 threads and 6.5 s with 1 (issue 27; ``python -m benchmarks.bench_threads`` measures
it on the machine at hand). ``auto`` therefore takes torch's count (which honours
``OMP_NUM_THREADS``) less the cores other processes keep busy, measured from ``/proc/stat``
over a fraction of a second at the start, split between the ranks that share the machine
under torchrun; at least 1. Load that starts later is not seen: pass ``--threads`` then.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Optional

SAMPLE_SECONDS = 0.3


def _cpu_times(cpus: set) -> Optional[dict]:
    """{cpu: (busy ticks, total ticks)} of the CPUs in ``cpus`` from /proc/stat, or None."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    times = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            values = [int(v) for v in fields[:8]]
            idle = values[3] + values[4]  # idle + iowait; steal (values[7]) counts as busy
            times[int(name[3:])] = (sum(values) - idle, sum(values))
    return times or None


def usable_cpus() -> set:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def busy_cpus(seconds: float = SAMPLE_SECONDS) -> Optional[float]:
    """How many of this process's usable CPUs other processes kept busy over ``seconds`` (this
    process sleeps meanwhile), e.g. 1.0 when another process holds one core; None where
    /proc/stat cannot be read."""
    cpus = usable_cpus()
    before = _cpu_times(cpus)
    if before is None:
        return None
    time.sleep(seconds)
    after = _cpu_times(cpus)
    if after is None:
        return None
    busy = 0.0
    for cpu, (b0, t0) in before.items():
        b1, t1 = after.get(cpu, (b0, t0))
        busy += (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
    return busy


def auto_threads(local_ranks: int = 1, busy: Optional[float] = None) -> tuple[int, str]:
    """(threads, why): torch's thread count less the busy cores, over ``local_ranks``, >= 1."""
    import torch

    base = torch.get_num_threads()
    busy = busy_cpus() if busy is None else busy
    if busy is None:
        return max(1, base // local_ranks), f"torch's {base}"
    held = int(busy + 0.5)
    free = max(1, min(base, len(usable_cpus()) - held))
    n = max(1, free // local_ranks)
    why = f"{held} of {len(usable_cpus())} cores busy" + (f", {local_ranks} ranks" if local_ranks > 1 else "")
    return n, why


# More threads than this per usable CPU only slow torch down, and far more end the process: torch
# 2.13's thread pool crashed it (a segmentation fault, no message) at --threads 1000000.
MAX_THREADS_PER_CPU = 4


def max_threads() -> int:
    return MAX_THREADS_PER_CPU * len(usable_cpus())


def threads_arg(text: str):
    """argparse type of ``--threads``: a positive int up to :func:`max_threads`, or "auto"."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= max_threads():
        raise argparse.ArgumentTypeError(f"expected a positive int up to {max_threads()} ({MAX_THREADS_PER_CPU} per "
                                         f"CPU this process may run on) or 'auto', got {text!r}")
    return n


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=threads_arg, default="auto",
                        help="torch threads: a number, or auto (default): one per core less the cores other "
                             "processes keep busy at the start (see qkmla.utils.threads)")


def apply_threads(value, command: str, quiet: bool = False) -> int:
    """Set torch's thread count from ``--threads`` (``value``: an int or "auto"); returns it.
    With auto, a count below torch's is announced on stderr (it explains a slower run)."""
    import sys

    import torch

    if value == "auto":
        base = torch.get_num_threads()
        from .environment import dist_environment

        n, why = auto_threads(dist_environment()[2])
        if n < base and not quiet:
            print(f"qkmla {command}: {n} thread{'s' * (n > 1)} ({why}; --threads to choose)", file=sys.stderr)
    else:
        n = value
    torch.set_num_threads(n)
    return n
