"""What the benchmarks share: the one way a benchmark writes its results record
(:func:`start_record`), the checks of their count arguments, the cells of the transformers
benchmarks run each in a process of its own (:func:`run_cells`), and for the transformers recipes
(``hf_qknorm_recipe``, ``gqa_convert_recipe``) and ``vllm_serving`` the refusal to reuse work
directories and the embedded Shakespeare's plays as byte tokens."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]  # the repository: its commit is the code a record came from


def positive(text: str) -> int:
    """An argparse type: an int >= 1, refused naming the value otherwise."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def check_out(parser, out: Optional[Path], overwrite: bool, name: str = "--out") -> None:
    """Refuse (``parser.error``) an output file that is a directory, or exists without
    ``overwrite`` (``qkmla.utils.files.check_output``); None: nothing will be written."""
    from qkmla.utils.files import check_output

    try:
        check_output(name, [out] if out is not None else [], [], overwrite)
    except ValueError as e:
        parser.error(str(e))


def command(module: str, argv: Optional[Sequence[str]] = None) -> str:
    """How this run was started, to rerun it: ``python -m MODULE ARGS`` (``sys.argv[1:]`` when
    ``argv`` is None) after the allocator's environment (``qkmla.utils.machine.recorded_command``)."""
    from qkmla.utils.machine import recorded_command

    return recorded_command(f"-m {module}", argv)


def start_record(parser, args, module: str, argv: Optional[Sequence[str]] = None, *, load_at_start: bool = False,
                 **fields) -> tuple[dict, Callable[[], None]]:
    """The one way a benchmark writes its results. Before any work, ``args.out`` is refused
    (``parser.error``) if it is a directory, or exists without ``args.overwrite``. Returns
    (record, write): the record starts with the command as it was run (:func:`command`), the
    commit of this checkout ("+dirty" when its code differs from it: ``source_commit``) and the
    machine (``qkmla.utils.machine.machine``, taken now: set torch's threads first), then
    ``fields``; ``write()`` writes it to ``args.out`` as JSON (the directory made; nothing
    when ``args.out`` is None), atomically, with the seconds since this call and the one-minute
    load average at the time (with ``load_at_start``: ``{"start": ..., "end": ...}``), says so,
    and may be called after every stage so that an interrupted run keeps what it measured."""
    from qkmla.utils.files import write_text
    from qkmla.utils.machine import machine, source_commit

    check_out(parser, args.out, args.overwrite)
    started, load = time.perf_counter(), round(os.getloadavg()[0], 2)
    record = {"command": command(module, argv), "commit": source_commit(ROOT), "machine": machine(), **fields}

    def write() -> None:
        now = round(os.getloadavg()[0], 2)
        record["wall_s"] = round(time.perf_counter() - started, 1)
        record["load_average_1min"] = {"start": load, "end": now} if load_at_start else now
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_text(args.out, json.dumps(record, indent=1) + "\n")
            print(f"wrote {args.out}", flush=True)

    return record, write


def start_recipe(parser, args, module: str, argv: Optional[Sequence[str]], work_dirs) -> tuple[dict, Callable]:
    """:func:`start_record` for the transformers recipes: torch on ``args.threads`` threads (0:
    torch's), the record with ``status`` "running", the run's settings and the transformers
    version, transformers' logging quiet, and ``work_dirs`` claimed (:func:`claim_work_dirs`)."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    record, write = start_record(parser, args, module, argv, status="running", settings=settings_of(args))
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    claim_work_dirs(parser, work_dirs, args.overwrite)
    record["transformers"] = transformers.__version__
    return record, write


@contextlib.contextmanager
def torch_threads(n: int):
    """torch on ``n`` threads inside (0: as it is), and the caller's count given back after (a
    caller in the same process, the tests, keeps its own)."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def settings_of(args) -> dict:
    """A run's arguments as a record holds them (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def claim_work_dirs(parser, dirs, overwrite: bool) -> None:
    """Refuse (``parser.error``) work directories that exist unless ``overwrite``; then empty them."""
    taken = [str(d) for d in dirs if d.exists()]
    if taken and not overwrite:
        parser.error(f"--work: {', '.join(taken)} exist; pass --overwrite to replace them, or give another --work")
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def byte_plays(tokenizer):
    """(training-play ids, validation-play ids): the embedded Shakespeare split by play
    (``qkmla.train.data.split_by_play``), as byte tokens of ``tokenizer`` without special tokens."""
    import torch

    from qkmla.train.data import load_text, split_by_play

    splits = split_by_play(load_text("shakespeare"))
    return tuple(torch.tensor(tokenizer(splits[s], add_special_tokens=False)["input_ids"]) for s in ("train", "val"))


def add_cell_options(parser, *, threads: int, threads_help: str, quick: Optional[str] = None) -> None:
    """The options every benchmark whose cells run in processes of their own shares: ``--threads``
    (default ``threads``), ``--quick`` (when its help is given), ``--out``, ``--overwrite`` and the
    internal ``--cell`` (:func:`run_cells` starts each cell with it)."""
    parser.add_argument("--threads", type=int, default=threads, help=threads_help)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--cell", help=argparse.SUPPRESS)  # internal: one cell, in a fresh process


def check_counts(parser, args, names: Sequence[str]) -> None:
    """Refuse (``parser.error``, naming the flag) each of ``names`` below 1, and ``--threads``
    below 0 (0: torch's default)."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive int, got {getattr(args, name)}")
    if args.threads < 0:
        parser.error(f"--threads: expected an int >= 0 (0: torch's default), got {args.threads}")


def parse_cell_args(parser, argv, run_cell: Callable, positive_ints: Sequence[str] = ("steps",)):
    """``parser``'s arguments after the checks every cell benchmark shares (``--threads`` >= 0,
    ``--warmup`` >= 0, each of ``positive_ints`` >= 1, ``--contexts`` >= 2: ``parser.error``
    naming the flag); None when this process was started for one ``--cell``, whose row
    (``run_cell(**cell)``) it has printed as its last stdout line."""
    args = parser.parse_args(argv)
    if args.cell:
        print(json.dumps(run_cell(**json.loads(args.cell))))
        return None
    check_counts(parser, args, positive_ints)
    if args.warmup < 0:
        parser.error(f"--warmup: expected an int >= 0, got {args.warmup}")
    if any(c < 2 for c in args.contexts):
        parser.error(f"--contexts: expected ints >= 2, got {args.contexts}")
    return args


def run_cell_grid(parser, args, argv, module: str, shape: dict, summarize: Callable,
                  variant_steps: Optional[dict] = None, **fields) -> None:
    """A transformers cell benchmark's whole run: its record (:func:`start_record`) with the
    installed transformers and ``shape``, one cell per (``--dtypes``, ``--contexts``,
    ``--variants``) with ``--steps`` (or ``variant_steps[variant]``: a slow baseline timed over
    fewer steps), ``--warmup``, ``--threads`` and ``fields`` (:func:`run_cells`), then the summary
    printed (the whole record when there is no ``--out``)."""
    result, write = start_record(parser, args, module, argv)

    import transformers

    result.update(transformers=transformers.__version__, shape=shape, rows=[])
    steps = variant_steps or {}
    cells = [dict(dtype_name=dtype, context=context, variant=variant, steps=steps.get(variant, args.steps),
                  warmup=args.warmup, threads=args.threads, **fields)
             for dtype in args.dtypes for context in args.contexts for variant in args.variants]
    run_cells(module, cells, result, write, summarize)
    print(json.dumps(result["summary"], indent=1) if args.out is not None else json.dumps(result, indent=1))


def run_cells(module: str, cells: Sequence[dict], result: dict, write: Callable,
              summarize: Optional[Callable] = None) -> list:
    """Measure each cell (a dict of ``run_cell``'s arguments: ``context`` and, where the benchmark
    has them, ``dtype_name`` and ``variant``) in a process of its own (``python -m MODULE --cell
    JSON``, whose last stdout line is its row), appending the rows to ``result["rows"]``. A cell
    that fails is recorded with its error, not fatal: the other cells still run. The summary (if
    any) and the result file are rewritten after every cell, so an interrupted run keeps what it
    measured."""
    rows = result["rows"]
    for cell in cells:
        proc = subprocess.run([sys.executable, "-m", module, "--cell", json.dumps(cell)],
                              capture_output=True, text=True, env=os.environ)
        if proc.returncode == 0:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        else:
            row = {{"dtype_name": "dtype"}.get(k, k): cell[k] for k in ("dtype_name", "context", "variant") if k in cell}
            row["error"] = f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-3:]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        if summarize is not None:
            result["summary"] = summarize(rows)
        write()
    return rows
