"""What machine a result was measured on, for every results file (benchmarks, experiments)."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

# Environment variables that change how the C allocator hands out large blocks. With glibc's
# defaults every allocation over its mmap threshold is fresh pages, faulted in on first
# touch; a step that allocates hundreds of MB pays that every call, more on some VMs than
# on others, so a timing is only comparable with the allocator it ran under. glibc's
# MALLOC_* tunables, jemalloc's MALLOC_CONF and tcmalloc's TCMALLOC_* all match these.
ALLOCATOR_ENV = ("MALLOC_", "TCMALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD")


def allocator_env() -> dict:
    """The environment variables named by (or starting with) an :data:`ALLOCATOR_ENV` entry
    that are set in this process, sorted by name ({}: the C library's defaults)."""
    return {name: os.environ[name] for name in sorted(os.environ) if name.startswith(ALLOCATOR_ENV)}


def env_prefix() -> str:
    """:func:`allocator_env` as a shell prefix ("NAME=value ... ", values quoted), so a recorded
    command reruns as it ran."""
    return "".join(f"{name}={shlex.quote(value)} " for name, value in allocator_env().items())


def recorded_command(script: str, argv: Optional[Sequence[str]] = None) -> str:
    """The command a results file records: ``python script`` and its arguments (``sys.argv[1:]``
    when ``argv`` is None), quoted, after the allocator's environment (:func:`env_prefix`), so
    it reruns as it ran."""
    args = sys.argv[1:] if argv is None else argv
    return env_prefix() + " ".join(["python", script, *map(shlex.quote, args)])


RESULTS_DIR = "benchmarks/results"  # data, not code: rewriting a results file leaves the code clean


def source_commit(path) -> Optional[str]:
    """The commit of the git checkout that holds ``path`` ("+dirty" when tracked files other
    than those under ``RESULTS_DIR`` differ from it), or None outside a checkout or without
    git: the code a results file came from. A benchmark that rewrites its own committed
    results file as it runs (or runs beside another that does) is still at a clean commit."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()
    try:
        rev = git("rev-parse", "HEAD")
        # Paths relative to the checkout's top, whatever folder ``path`` is in.
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ":/",
                    f":(top,exclude){RESULTS_DIR}")
    except (OSError, subprocess.CalledProcessError):
        return None
    return rev + ("+dirty" if dirty else "")


def machine() -> dict:
    """CPU model and core count, torch threads and version, Python, platform, the allocator's
    environment (:func:`allocator_env`), and the GPU if any."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "allocator_env": allocator_env()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
