"""What machine a result was measured on, for every results file (benchmarks, experiments)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine() -> dict:
    """CPU model and core count, torch threads and version, Python, platform, and the GPU if any."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info
