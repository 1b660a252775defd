"""Every GPU figure qkmla needs, in one command, within a time budget. From the repository root,
with this checkout installed (the device machine gets a copy of the working tree and no qkmla;
``--no-deps``: torch and Triton are the machine's own; where the install cannot build offline,
setuptools older than 70.1 without ``wheel``, ``export PYTHONPATH=src`` instead):

    python -m pip install --no-deps --no-build-isolation -e .
    python -m benchmarks.gpu.run [--budget-min 20] [--out DIR] [--parts NAME ...] [--overwrite] [--wheels DIR]
    python -m benchmarks.gpu.run --dry-run [--out DIR]    # the same code, on the CPU, at tiny shapes
    python -m benchmarks.gpu.run --summarize DIR          # rebuild DIR/summary.md from its part files

A run refuses a qkmla imported from anywhere but this checkout's ``src/`` (the results name
its commit). Parts, in order of value (``PARTS``; each a module ``part_<name>`` of this package):

    1 correctness    the CUDA tests; the Triton kernel against the spec at real sizes; the compiled step
    2 kernel         decode kernel timing: 16 and 128 heads, 4k-256k, batch 1 and ~1M tokens, fp8 vs bf16
    3 model_decode   whole-model decode tokens/s: latent cache (compiled, eager), full-KV cache, transformers
    4 training       training tokens/s of mla-qknorm against mla (shakespeare, paper-400m), bf16
    5 qk_clip        QK-norm against QK-Clip at the paper-400m shape, for the steps that fit
    6 torchtitan     torchtitan's DeepSeek-V3 (1.9B) plain, QK-normed and clipped: tokens/s, MFU, memory, loss
    7 vllm           vLLM decode: a QK-normed checkpoint through qkmla's plugin against stock TRITON_MLA and FlashMLA

Each part runs in its own process (a crash, e.g. a CUDA fault, cannot take the next part
with it) with its share of the budget that is left (``Part.minutes``, rescaled): it starts no
new work past its deadline and is killed ``GRACE_S`` after it. It writes its results file
``<n>_<part>.json`` as rows arrive (a temporary file renamed over it), so a part that fails
or is killed keeps what it measured; its output goes to ``<n>_<part>.log``. After every part,
``summary.md`` (device, torch / Triton / CUDA versions, commits, commands, every part's
tables) and ``suite.json`` (an index) are rebuilt from every part file in ``--out``, so the
parts may be run by several commands into one directory (a machine that allows 10 minutes
per command: ``--parts correctness kernel``, then the rest). A part whose files are already
in ``--out`` is refused unless ``--overwrite`` is given; other parts' files are never touched.
Exit status: 0 when every part ran and every correctness check passed, 1 otherwise, 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import torch

from qkmla.utils.files import write_text

from . import suite
from ..common import command as recorded_command


@dataclass(frozen=True)
class Part:
    name: str
    module: Union[str, Path]  # a module with run(ctx) and summarize(record): its name, or a file of its own
    minutes: float  # its share of the default 20-minute budget (shares are rescaled to --budget-min)


# The vLLM part takes a share only where vLLM is installed: elsewhere it is skipped at once, and
# the other parts keep the budgets they had before it was added.
VLLM_MINUTES = 3.0 if importlib.util.find_spec("vllm") is not None else 0.05
PARTS = tuple(Part(name, f"{__package__}.part_{name}", minutes) for name, minutes in (
    ("correctness", 5.0), ("kernel", 7.0), ("model_decode", 3.0), ("training", 3.0), ("qk_clip", 2.0),
    ("torchtitan", 3.0), ("vllm", VLLM_MINUTES)))
GRACE_S = 60.0  # how long past its deadline a part may take to stop (a compile it had started) before it is killed


def load(module: Union[str, Path]):
    """A part's module: imported by name, or loaded from its file (a path ending in .py)."""
    if not str(module).endswith(".py"):
        return importlib.import_module(str(module))
    spec = importlib.util.spec_from_file_location(Path(module).stem, module)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def result_path(out: Path, index: int, part: Part) -> Path:
    return out / f"{index}_{part.name}.json"


# -- the worker: one part in this process ----------------------------------------------------

def run_worker(part: Part, path: Path, budget_s: float, dry_run: bool, command: str) -> int:
    device = torch.device("cpu" if dry_run else "cuda")
    ctx = suite.PartContext(part.name, path, dry_run, budget_s, device)
    ctx.record = suite.new_record(part.name, dry_run, budget_s, command)
    ctx.save()
    try:
        load(part.module).run(ctx)
        if ctx.record["status"] == "running":
            ctx.record["status"] = "ok"
    except Exception as e:
        ctx.record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        traceback.print_exc()
    ctx.save()
    return 0 if ctx.record["status"] in ("ok", "partial", "skipped") else 1


# -- the parent: every part, each in a child process -----------------------------------------

def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the part and what it started (its pytest run, the compiler's workers): the child
    leads its own process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def run_part(part: Part, index: int, out: Path, budget_s: float, grace_s: float, dry_run: bool, command: str,
             env: dict) -> dict:
    path, log_path = result_path(out, index, part), out / f"{index}_{part.name}.log"
    cmd = [sys.executable, "-m", __spec__.name, "--worker", part.name, "--worker-module", str(part.module),
           "--worker-result", str(path), "--worker-budget-s", f"{budget_s:.1f}", "--worker-command", command]
    if dry_run:
        cmd.append("--dry-run")
    print(f"== part {index} {part.name}: {budget_s / 60:.1f} min", flush=True)
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=suite.REPO, start_new_session=True)

        def pump():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                sys.stdout.write(line)
                sys.stdout.flush()
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=budget_s + grace_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.wait()
        reader.join(timeout=10)
    for tmp in out.glob(f"{path.name}.tmp*"):  # a save the kill interrupted; the renamed file is whole
        tmp.unlink()
    record = json.loads(path.read_text()) if path.is_file() else {"part": part.name, "status": "running"}
    tail = log_path.read_text()[-3000:] if log_path.is_file() else ""
    if timed_out:
        record.update(status="timeout", error=f"killed {grace_s:.0f} s past its {budget_s:.0f} s budget; "
                                              f"the rows it had written are kept", log_tail=tail)
    elif record.get("status") == "running":
        record.update(status="failed", error=f"its process exited with code {rc} before finishing "
                                             f"(see {log_path.name})", log_tail=tail)
    record["wall_seconds"] = round(time.monotonic() - t0, 1)
    suite.write_json(path, record)
    print(f"== part {index} {part.name}: {record['status']} in {record['wall_seconds']:.0f} s -> {path}", flush=True)
    return record


def read_results(out: Path, parts: tuple) -> list[tuple[int, Part, dict]]:
    """(index, part, record) of every part whose results file is in ``out``, in part order."""
    found = []
    for i, part in enumerate(parts, 1):
        path = result_path(out, i, part)
        if path.is_file():
            try:
                found.append((i, part, json.loads(path.read_text())))
            except json.JSONDecodeError as e:
                found.append((i, part, {"part": part.name, "status": "unreadable", "error": f"{path.name}: {e}"}))
    return found


def render_summary(found: list[tuple[int, Part, dict]]) -> str:
    """summary.md from the part records: the device, versions, commit and command, then
    every part's status and tables (parts may come from several commands: each is named)."""
    env = next((r["environment"] for _, _, r in found if r.get("environment", {}).get("gpu")),
               next((r["environment"] for _, _, r in found if r.get("environment")), {}))
    device = env.get("gpu") or f"CPU: {env.get('cpu', '?')}"
    lines = [f"# qkmla GPU suite: {device}", ""]
    if any(r.get("dry_run") for _, _, r in found):
        lines += ["**Dry run** on the CPU at tiny shapes (Triton in its interpreter): it checks the code paths and "
                  "the files' shape; its figures measure nothing.", ""]
    gpu = (f"{env['gpu']} (compute {env.get('gpu_capability')}, {env.get('gpu_sms')} SMs, "
           f"{env.get('gpu_memory_gib')} GiB), driver {env.get('driver')}" if env.get("gpu") else "none")
    commands = list(dict.fromkeys(r.get("command") for _, _, r in found if r.get("command")))
    commits = list(dict.fromkeys(r.get("commit") for _, _, r in found if r.get("commit")))
    lines += [f"- command{'s' if len(commands) > 1 else ''}: " + "; ".join(f"`{c}`" for c in commands),
              f"- commit{'s' if len(commits) > 1 else ''}: {', '.join(commits) or None}", f"- GPU: {gpu}",
              f"- torch {env.get('torch')} (CUDA {env.get('torch_cuda')}, cuDNN {env.get('cudnn')}), Triton "
              f"{env.get('triton')}, transformers {env.get('transformers')}, Python {env.get('python')}",
              f"- CPU: {env.get('cpu')} ({env.get('cores')} cores)", ""]
    rows = []
    for i, p, r in found:
        e = r.get("environment", {})
        rows.append([f"{i} {p.name}", r.get("status"), suite.fmt(r.get("wall_seconds")), r.get("budget_s"),
                     e.get("gpu") or "CPU", r.get("started_at"), f"`{i}_{p.name}.json`"])
    lines += suite.table(["part", "status", "seconds", "budget (s)", "device", "started", "file"], rows)
    for i, part, record in found:
        lines += ["", f"## {i}. {part.name}", ""]
        if record.get("error") or record.get("reason"):
            lines += [f"**{record.get('status')}**: {record.get('error') or record.get('reason')}", ""]
        try:
            lines += load(part.module).summarize(record)
        except Exception as e:  # a summary must never hide the results file
            lines.append(f"(no table: {type(e).__name__}: {e}; see `{i}_{part.name}.json`)")
    return "\n".join(lines) + "\n"


def write_summary(out: Path, parts: tuple) -> list[tuple[int, Part, dict]]:
    """Rebuild summary.md and suite.json (an index) from every part file in ``out``."""
    found = read_results(out, parts)
    index = {p.name: {"status": r.get("status"), "file": result_path(out, i, p).name, "command": r.get("command"),
                      "commit": r.get("commit"), "device": r.get("environment", {}).get("gpu"),
                      "started_at": r.get("started_at"), "wall_seconds": r.get("wall_seconds")} for i, p, r in found}
    suite.write_json(out / "suite.json", {"parts": index})
    write_text(out / "summary.md", render_summary(found))
    return found


def part_files(out: Path, index: int, part: Part) -> list[Path]:
    """What a part writes: its results, its log and (correctness) the pytest report."""
    stem = f"{index}_{part.name}"
    return [out / f"{stem}.json", out / f"{stem}.log", out / f"{stem}_pytest.xml"]


def install_wheels(wheels: Path) -> str:
    """pytest from local wheels into a temporary directory (the device has no network and
    maybe no pytest); returns the directory to put on PYTHONPATH."""
    target = tempfile.mkdtemp(prefix="qkmla-gpu-wheels-")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                    "--target", target, "pytest"], check=True)
    return target


def default_out(dry_run: bool) -> Path:
    if dry_run:
        return Path(tempfile.mkdtemp(prefix="qkmla-gpu-dry-run-"))
    name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return suite.REPO / "benchmarks" / "results" / "gpu" / name


def parse_args(argv, parts: tuple = PARTS):
    names = [p.name for p in parts]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-min", type=float, default=20.0, help="minutes for the chosen parts together (default 20)")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory (default benchmarks/results/gpu/<gpu name>; a dry run: a new temp dir)")
    p.add_argument("--parts", nargs="+", default=names, metavar="NAME", help=f"parts to run, of {names} (default all)")
    p.add_argument("--overwrite", action="store_true", help="replace the chosen parts' results already in --out")
    p.add_argument("--dry-run", action="store_true", help="the same code paths on the CPU at tiny shapes")
    p.add_argument("--wheels", type=Path, default=None, help="a directory of wheels to install pytest from")
    p.add_argument("--summarize", type=Path, default=None, metavar="DIR",
                   help="only rebuild DIR/summary.md from the part files in DIR (no GPU needed)")
    for hidden in ("--worker", "--worker-module", "--worker-result", "--worker-budget-s", "--worker-command"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return p, args
    if args.summarize is not None:
        if not read_results(args.summarize, parts):
            p.error(f"--summarize: no part results (1_correctness.json, ...) in {args.summarize}")
        return p, args
    if not args.budget_min > 0 or args.budget_min == float("inf"):
        p.error(f"--budget-min: expected a positive number of minutes, got {args.budget_min}")
    if any(n not in names for n in args.parts) or len(set(args.parts)) != len(args.parts):
        p.error(f"--parts: expected distinct names of {names}, got {args.parts}")
    if args.wheels is not None and not args.wheels.is_dir():
        p.error(f"--wheels: {args.wheels} is not a directory")
    if (foreign := suite.foreign_qkmla()) is not None:
        p.error(foreign)
    if not args.dry_run and not torch.cuda.is_available():
        p.error("no CUDA device here: the suite measures a GPU; --dry-run runs its code paths on the CPU")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        p.error(f"--out: {args.out} is a file, expected a directory")
    return p, args


def main(argv=None, parts: tuple = PARTS, grace_s: float = GRACE_S) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p, args = parse_args(argv, parts)
    if args.worker:
        part = Part(args.worker, args.worker_module, 0.0)
        return run_worker(part, Path(args.worker_result), float(args.worker_budget_s), args.dry_run,
                          args.worker_command)
    if args.summarize is not None:
        write_summary(args.summarize, parts)
        print(f"summary -> {args.summarize / 'summary.md'}")
        return 0
    out = args.out or default_out(args.dry_run)
    chosen = [(i, part) for i, part in enumerate(parts, 1) if part.name in args.parts]
    existing = [f for i, part in chosen for f in part_files(out, i, part) if f.exists()]
    if existing and not args.overwrite:  # checked before any work; other parts' results are never touched
        p.error(f"--out: {out} already holds results of these parts ({', '.join(f.name for f in existing)}); "
                "pass --overwrite to replace them, or choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    for f in existing:  # --overwrite: nothing of the earlier run of these parts is left to mix with this one
        f.unlink()
    command = recorded_command(__spec__.name, argv)
    env = dict(os.environ, TRITON_INTERPRET="1" if args.dry_run else "0")
    if args.wheels:
        try:  # pytest for the correctness part's tests, where the machine has none
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [install_wheels(args.wheels), env.get("PYTHONPATH")]))
        except (OSError, subprocess.CalledProcessError) as e:  # the tests are skipped with the reason; the rest runs
            print(f"--wheels: could not install pytest from {args.wheels}: {e}", file=sys.stderr)
    print(f"results -> {out}", flush=True)
    deadline = time.monotonic() + 60 * args.budget_min
    done = []
    for k, (i, part) in enumerate(chosen):
        left = sum(q.minutes for _, q in chosen[k:])
        budget_s = max(1.0, (deadline - time.monotonic()) * part.minutes / left)
        done.append(run_part(part, i, out, budget_s, grace_s, args.dry_run, command, env))
        write_summary(out, parts)
    print(f"summary -> {out / 'summary.md'}", flush=True)
    ran = all(r.get("status") in ("ok", "partial", "skipped") for r in done)
    return 0 if ran and not sum(r.get("checks_failed", 0) for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
