"""What every part of the GPU suite shares: its context (device, deadline, result file),
atomic result files, the machine's versions, timers and the HBM roofline.

A part is a module with ``run(ctx)`` (fills ``ctx.record`` and calls ``ctx.save()`` as rows
arrive, so a part stopped at its deadline or killed keeps what it measured) and
``summarize(record) -> list[str]`` (its markdown for ``summary.md``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import itertools
import json
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

import qkmla
from qkmla.utils.files import write_text
from qkmla.utils.machine import machine, source_commit

from ..common import ROOT as REPO

# Datasheet HBM bandwidth (bytes/s). More specific names first: "H100 PCIe" before "H100".
HBM_PEAK = (("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H200", 4.8e12), ("H100", 3.35e12), ("H800", 3.35e12),
            ("H20", 4.0e12), ("A100", 2.0e12))
PART_STATUSES = ("running", "ok", "partial", "skipped", "failed", "timeout")


def write_json(path: Path, obj) -> None:
    """``obj`` as JSON, atomically (``qkmla.utils.files.write_text``): a reader (or a kill)
    never sees half a file."""
    write_text(path, json.dumps(obj, indent=1, default=str) + "\n")


def foreign_qkmla() -> Optional[str]:
    """Why the qkmla imported here is not this checkout's (the code a results file names), or
    None: the suite runs with the checkout installed, ``python -m pip install --no-deps
    --no-build-isolation -e .`` from the repository root, or where that cannot build offline
    (setuptools older than 70.1 without ``wheel``) with ``PYTHONPATH=src`` in the environment
    (the device machine gets a copy of the working tree, without qkmla installed)."""
    where = Path(qkmla.__file__).resolve().parent
    if where.is_relative_to(REPO / "src"):
        return None
    return (f"qkmla is imported from {where}, not from this checkout ({REPO / 'src'}): run "
            "`python -m pip install --no-deps --no-build-isolation -e .` in the repository root first "
            "(or set PYTHONPATH=src)")


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """The machine (``qkmla.utils.machine.machine``), the versions that decide what runs (torch,
    CUDA, cuDNN, Triton, transformers), and the GPU: name, compute capability, SMs, memory,
    driver."""
    info = machine()
    info.update(torch_cuda=torch.version.cuda, triton=_version("triton"), transformers=_version("transformers"))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}",
                    gpu_sms=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                    cudnn=torch.backends.cudnn.version())
        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                info["driver"] = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                                capture_output=True, text=True, timeout=20).stdout.strip() or None
            except (OSError, subprocess.SubprocessError):
                info["driver"] = None
    return info


def hbm_peak(device: torch.device) -> tuple[Optional[float], str]:
    """(datasheet HBM bandwidth in bytes/s, where it came from); (None, why) off a known GPU."""
    if device.type != "cuda":
        return None, "no datasheet peak off a GPU"
    name = torch.cuda.get_device_name(device)
    for key, peak in HBM_PEAK:
        if key in name:
            return peak, f"{name}: {key} datasheet"
    return None, f"{name}: no datasheet peak known (add it to HBM_PEAK)"


@dataclass
class PartContext:
    """What a part runs with. ``record`` is its results file's content, ``save()`` writes it."""

    name: str
    path: Path
    dry_run: bool
    budget_s: float
    device: torch.device
    started: float = field(default_factory=time.monotonic)
    record: dict = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return self.path.parent

    @property
    def stem(self) -> str:
        return self.path.stem

    def time_left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def out_of_time(self, reserve_s: float = 0.0) -> bool:
        """Whether the part should start nothing more (``reserve_s``: what it still needs after)."""
        return self.time_left() <= reserve_s

    def save(self) -> None:
        self.record["seconds"] = round(time.monotonic() - self.started, 2)
        write_json(self.path, self.record)

    def log(self, message: str) -> None:
        print(f"[{self.name} {time.monotonic() - self.started:7.1f}s] {message}", flush=True)

    def skipped_without(self, module: str, how_to_install: str) -> bool:
        """True, with the record marked skipped, when ``module`` is not installed here (the part
        then returns: a GPU machine may lack an optional library; ``how_to_install`` says how)."""
        if importlib.util.find_spec(module) is not None:
            return False
        self.record.update(status="skipped", reason=f"{module} is not installed here ({how_to_install})")
        return True

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def new_record(name: str, dry_run: bool, budget_s: float, command: str) -> dict:
    return {"part": name, "status": "running", "dry_run": dry_run, "budget_s": round(budget_s, 1),
            "command": command, "commit": source_commit(REPO), "environment": environment(),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def covering_first(axes: dict) -> list[dict]:
    """Every combination of the axes' values (a dict name -> values), led by a covering
    subset: case i of the first max(len) cases takes value i mod len of each axis, so a run
    cut short at its deadline has still seen every value of every axis."""
    names = list(axes)
    n = max(len(v) for v in axes.values())
    first = [tuple(axes[k][i % len(axes[k])] for k in names) for i in range(n)]
    rest = [c for c in itertools.product(*axes.values()) if c not in first]
    return [dict(zip(names, c)) for c in first + rest]


def covering(axes: dict) -> list[dict]:
    """Only the covering subset of :func:`covering_first` (what a dry run checks)."""
    return covering_first(axes)[:max(len(v) for v in axes.values())]


def free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_unit(ctx: "PartContext", label: str, work: Callable[[], list]) -> None:
    """One unit of a part's work: the rows ``work()`` returns join ``ctx.record["rows"]``; an exception
    (out of memory, a compile failure) is recorded under "errors" with the part "partial", and the
    next unit runs; then the record is saved."""
    try:
        ctx.record["rows"] += work()
    except Exception as e:
        ctx.record.setdefault("errors", []).append(f"{label}: {type(e).__name__}: {e}")
        ctx.record["status"] = "partial"
        free_memory()
    ctx.log(f"{label} done")
    ctx.save()


def reset_compiler(recompile_limit: int = 64) -> None:
    """Forget every compiled graph (and the CUDA graphs they recorded), and allow enough
    recompiles that a shape change never falls back to eager silently."""
    import torch._dynamo

    torch._dynamo.reset()
    for name in ("recompile_limit", "cache_size_limit"):  # renamed in torch 2.6; both spell it since
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, recompile_limit)


def bench(fn: Callable[[], object], ctx: PartContext, warmup_ms: int = 25, rep_ms: int = 100,
          cpu_reps: int = 2) -> float:
    """Seconds per call of ``fn``, the median. On a GPU: Triton's ``do_bench`` (CUDA events,
    the L2 cache flushed before every call, as FlashMLA and FlashAttention time kernels). On
    the CPU (the dry run): ``cpu_reps`` wall-clock calls after one warm-up."""
    if ctx.device.type == "cuda":
        from triton.testing import do_bench

        try:
            ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
        except TypeError:  # a Triton without return_mode: its default (the mean)
            ms = do_bench(fn, warmup=warmup_ms, rep=rep_ms)
        return ms / 1e3
    fn()
    times = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def graphed(fn: Callable[[], object], ctx: PartContext) -> tuple[Callable[[], object], str]:
    """(a callable replaying ``fn`` from a captured CUDA graph, "cuda-graph") on a GPU, so a
    timing holds the GPU's work and not Python's launch overhead; (fn, "eager") elsewhere."""
    if ctx.device.type != "cuda":
        return fn, "eager"
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay, "cuda-graph"


def copy_bandwidth(ctx: PartContext) -> float:
    """Bytes/s of one large device-to-device copy (read + write), measured: what the memory
    system delivers to a simple streaming kernel, beside the datasheet peak."""
    n = (1 << 28) if ctx.device.type == "cuda" else (1 << 22)  # 1 GiB on a GPU, 16 MiB on a CPU
    x = torch.empty(n, dtype=torch.float32, device=ctx.device)
    y = torch.empty_like(x)
    seconds = bench(lambda: y.copy_(x), ctx)
    bandwidth = 2 * x.numel() * x.element_size() / seconds
    del x, y
    free_memory()
    return bandwidth


def fmt(value, digits: int = 1, suffix: str = "") -> str:
    """A table cell: '–' for a missing value."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{suffix}"
    return f"{value}{suffix}"


def sci(value) -> str:
    """A small error or tolerance: three significant digits; '–' when missing."""
    return "–" if value is None else f"{value:.3g}"


def table(header: list[str], rows: list[list]) -> list[str]:
    """Markdown table lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
