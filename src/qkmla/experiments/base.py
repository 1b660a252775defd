"""What an experiment is, the training settings they share, and the driver that runs one.

An experiment plans a list of :class:`~qkmla.experiments.grid.Run` from its options, may
measure something on each trained run, and reports: figures (PNG) and a summary (a dict
for ``summary.json`` and a Markdown table for ``summary.md``) computed from the rows of
``results.jsonl`` alone, so a report can be redrawn from the committed results file.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..train.checkpoint import FILENAME
from ..train.rundir import RUN_FILES, RunLock, read_rows, read_status, resume_edits
from ..utils.files import (check_own_directory, check_writable, input_file_problem, make_directory, same_file,
                           special_file, write_text)
from ..utils.machine import machine, source_commit
from ..utils.threads import usable_cpus
from .grid import (FINISHED, GridFailed, GridStopped, Run, archive_runs, differences, is_finished, run_dir, run_grid,
                   stop_requests, worker_pool)
from .numerics import GRID_THREADS, begun_under_other_numerics, describe as described, numerics
from .results import best_lr, read_results, summarize, write_results
from ..utils.checked import check_bool, is_int, python_numbers
from ..utils.environment import check_hash_seed


MAX_SEEDS = 1000  # seeds per variant: each is a training run; more is a typo (and a plan that fills memory)


def check_seeds(name: str, seeds) -> None:
    """A ValueError naming ``name`` unless ``seeds`` is None (the experiment's default) or an int from 1
    to :data:`MAX_SEEDS`."""
    if seeds is not None and (not is_int(seeds) or not 1 <= seeds <= MAX_SEEDS):
        default = "leave it out" if name.startswith("--") else "None"  # what the caller can write
        raise ValueError(f"{name}: expected an int from 1 to {MAX_SEEDS} (each seed is a training run per variant; "
                         f"{default} for the experiment's default), got {seeds!r}")


def check_workers(name: str, workers, bound: bool = True) -> None:
    """A ValueError naming ``name`` unless ``workers`` is 0 (one per CPU) or a positive int, up to the
    CPUs this process may run on if ``bound`` (the command line's --workers: more workers than its CPU
    set, taskset or a cgroup, share those CPUs and each run slows by as much, with nothing gained). A
    Python caller's Options is not bound: a script written on a larger machine still runs, slower."""
    cpus = len(usable_cpus())
    if not is_int(workers) or workers < 0 or (bound and workers > cpus):
        upto = f"an int up to the {cpus} CPU(s) this process may run on (its affinity)" if bound else "a positive int"
        raise ValueError(f"{name}: expected 0 (one per CPU) or {upto}, got {workers!r}")


@dataclass(frozen=True)
class Options:
    """out: the experiment's directory; quick: the test-sized grid; seeds: seeds per
    variant (None: the experiment's default); workers: processes (0: one per core);
    sweep: an lr-sweep ``results.jsonl`` for experiments that train at each variant's best
    learning rate (default: ``OUT/../lr-sweep/results.jsonl``); overwrite: replace what ``out``
    holds of another experiment, or finished runs trained with other settings (without it,
    refused before any work)."""

    out: Path
    quick: bool = False
    seeds: Optional[int] = None
    workers: int = 0
    sweep: Optional[Path] = None
    overwrite: bool = False

    def __post_init__(self) -> None:
        # Built from Python (run_experiment's callers) as well as by the command line, which checks its
        # flags first: overwrite="no" or quick="no" were truthy (another experiment's files replaced, the
        # quick grid run), workers=-1 and seeds=0 reached the grid's arithmetic.
        python_numbers(self)  # np.int64(2) seeds was refused as "expected an int from 1 to 1000, got np.int64(2)"
        for name in ("quick", "overwrite"):
            check_bool(name, getattr(self, name))
        # a str out reached every report's options.out / "x.png" (redraw passes its dst as given)
        if not isinstance(self.out, (str, os.PathLike)):
            raise ValueError(f"out: expected the experiment's directory (a path), got {self.out!r}")
        object.__setattr__(self, "out", Path(self.out))
        if self.sweep is not None:  # sweep=5 was taken, and failed where an experiment read it as a path
            if not isinstance(self.sweep, (str, os.PathLike)):
                raise ValueError(f"sweep: expected an lr-sweep results.jsonl (a path) or None, got {self.sweep!r}")
            object.__setattr__(self, "sweep", Path(self.sweep))
        check_seeds("seeds", self.seeds)
        check_workers("workers", self.workers, bound=False)

    def seed_list(self, default: int) -> list[int]:
        n = self.seeds or (1 if self.quick else default)
        return list(range(1, n + 1))

    @property
    def sweep_results(self) -> Path:
        return self.sweep or self.out.parent / "lr-sweep" / "results.jsonl"


@dataclass(frozen=True)
class Report:
    summary: dict
    table: str  # Markdown
    figures: list


@dataclass(frozen=True)
class Experiment:
    """``adaptive``: later runs depend on earlier results (a learning rate chosen from a
    bracket, a threshold from a run's max logit), so the driver trains the first unfinished
    runs of the plan, and as each run ends rewrites the results and plans again; the plan lists
    runs in the order they should finish."""

    name: str
    description: str
    plan: Callable[[Options], list[Run]]
    report: Callable[[list[dict], Options], Report]
    measure: Optional[Callable[[Path], dict]] = None
    adaptive: bool = False
    thin_metrics: Optional[Callable[[list[dict]], list[dict]]] = None  # archived metrics rows (redraw)
    reads_sweep: bool = False  # trains at the lr-sweep's best rates (--sweep); other experiments pick their own
    # Options.seeds sets its seeds per variant; a pre-registered design fixes its own (--seeds refused)
    reads_seeds: bool = True
    # An adaptive experiment whose runs are fixed in advance (a pre-registered design): every run, of which the
    # plan lists those trainable now. A stop counts the rest as not started too; without it, the number of later
    # runs is not known (they depend on results) and the stop line says that more follow.
    design: Optional[Callable[[Options], list[Run]]] = None


def train_settings(quick: bool, steps: int, **changes) -> dict:
    """TrainConfig fields shared by the experiments: the ``cpu`` preset (nanoGPT's CPU model,
    4 x 4 x 128, 64-token context) on tiny Shakespeare; the ``debug`` preset for --quick."""
    if quick:
        base = dict(preset="debug", batch_size=4, block_size=16, steps=6, warmup_steps=2, eval_interval=3,
                    eval_iters=2, ckpt_interval=3)
    else:
        base = dict(preset="cpu", batch_size=12, steps=steps, warmup_steps=max(1, steps // 10),
                    eval_interval=100, eval_iters=20, ckpt_interval=100)
    return {**base, **changes}


DEFAULT_LR = 3e-3  # when no lr-sweep results are there to pick from


def sweep_lr(options: Options, variant: str = "mla-qknorm", optimizer: str = "adamw") -> tuple[float, str]:
    """The variant's best lr from the lr-sweep results if present, else DEFAULT_LR; and where
    it came from (recorded in the results)."""
    path = options.sweep_results
    problem = input_file_problem(path)
    if problem is not None and problem != "does not exist":  # a FIFO, a directory: not silently the default
        raise ValueError(f"sweep: the lr-sweep results {path} {problem}")
    if problem is None:
        return sweep_best_lr(path, variant, optimizer, options.sweep is not None), \
            f"best {optimizer} lr of {variant} in {path}"
    return DEFAULT_LR, f"default {DEFAULT_LR:g} (no lr-sweep results at {path})"


def sweep_best_lr(path: Path, variant: str, optimizer: str, given: bool = True) -> float:
    """The variant's best lr in the lr-sweep results file ``path``; a ValueError naming --sweep
    and the file when it holds no such rows (another command's file, or not JSON lines).
    ``given``: the user passed ``path`` as --sweep (else it is --sweep's default, and the
    message says so: the user typed no --sweep)."""
    try:
        return best_lr(read_results(path), variant, optimizer)[0]
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not rows of an lr-sweep (a JSON error too)
        name = "--sweep" if given else "--sweep (not given; its default is OUT/../lr-sweep/results.jsonl)"
        why = f"its rows have no {e} field" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ValueError(f"{name}: {path} holds no lr-sweep results with {variant} ({optimizer}) runs "
                         f"({why})") from None


def run_experiment(experiment: Experiment, options: Options, progress: bool = True,
                   command: Optional[str] = None) -> Report:
    """Plan, train what is not finished, write ``results.jsonl``, figures and summaries.
    ``command`` (the command line that ran it) is recorded in ``summary.json``.

    ``out`` is locked while the experiment runs (a second one on it is refused); what it holds
    of another experiment, the lr-sweep results it reads, and finished runs trained with other
    settings are refused before any work (the last two unless ``options.overwrite``). SIGINT or
    SIGTERM starts no new run, checkpoints the runs in flight (status ``interrupted`` or
    ``stopped``), writes the report and raises :class:`~qkmla.experiments.grid.GridStopped`; a
    second signal stops the runs at once. The same call again resumes them.
    """
    check_bool("progress", progress)
    check_hash_seed()  # its workers would die at their start: said before any work
    out = Path(options.out)
    _check_inputs(experiment, options)
    _check_report_files(out)
    make_directory("--out", out, "experiment directory")
    check_writable("--out", out)
    with RunLock(out), stop_requests() as stop:
        check_own_directory("--out", out, "experiment")
        _check_runs_directory(out)
        _check_out(experiment, options)
        runs = experiment.plan(options)
        _check_run_files(out, runs)
        _check_finished_logs(out, runs)
        t0 = time.perf_counter()
        if not experiment.adaptive:
            try:
                statuses = run_grid(runs, out, options.workers, experiment.measure, progress, stop=stop)
            except (GridStopped, GridFailed) as e:
                _write_stopped_report(experiment, options, runs, e, command, t0)
                raise
            return _write_report(experiment, options, runs, statuses, command, t0)
        statuses: dict[str, dict] = {}
        failed: set[str] = set()  # errors of this invocation are not retried until the next one
        batch = options.workers or len(usable_cpus())
        runs = experiment.plan(options)  # the latest plan: the report lists its runs

        def to_train() -> list[Run]:
            return [r for r in runs if r.same_as is None and r.name not in failed
                    and _pending(out, r, experiment.measure)]

        def ended(now: dict) -> None:
            statuses.update(now)
            failed.update(name for name, st in now.items() if st["status"] not in ("done", "non-finite"))
            _write_report(experiment, options, runs, statuses, command, t0)

        def refill(now: dict) -> list[Run]:
            """After each run ends: its row in the results, then the plan's runs still to train (a
            branch joins it once its stretch has finished), so that no worker waits for another's run."""
            nonlocal runs
            ended(now)
            runs = experiment.plan(options)
            return to_train()

        with worker_pool(batch) as pool:
            while todo := to_train():
                try:
                    now = run_grid(todo, out, options.workers, experiment.measure, progress, pool=pool,
                                   stop=stop, refill=refill)
                except (GridStopped, GridFailed) as e:
                    statuses.update(e.statuses)
                    _write_stopped_report(experiment, options, runs, e, command, t0, statuses)
                    if isinstance(e, GridStopped):  # the stop line counted the latest plan's runs alone
                        raise e.counting(_unplanned(experiment, options, runs)) from None
                    raise
                ended(now)
                runs = experiment.plan(options)
        return _write_report(experiment, options, runs, statuses, command, t0)


def _unplanned(experiment: Experiment, options: Options, plan: list[Run]) -> int:
    """How many runs of an adaptive experiment's design no plan lists yet (``plan``: the latest), none of
    them finished; -1 when it has no fixed design. qknorm-confirm stopped said "75 run(s) not started" of
    its 378, 202 finished: its plan lists a branch only once the stretch it continues has finished."""
    if experiment.design is None:
        return -1
    listed = {r.name for r in plan}
    return sum(1 for r in experiment.design(options) if r.name not in listed and r.same_as is None
               and not _done(options.out, r, experiment.measure))


def _done(out: Path, run: Run, measure) -> bool:
    return not _pending(out, run, measure)


def _check_inputs(experiment: Experiment, options: Options) -> None:
    """The lr-sweep results this experiment reads are never its output (whatever --overwrite says);
    seeds are given only to an experiment that reads them (the command line refuses --seeds so too)."""
    if options.seeds is not None and not experiment.reads_seeds:  # read by nothing: its design's seeds trained
        raise ValueError(f"seeds: {experiment.name} trains the seeds its design fixes (docs/results.md), so it takes "
                         f"no seeds; leave them out")
    results = Path(options.out) / "results.jsonl"
    sweep = options.sweep_results
    if experiment.name != "lr-sweep" and (same_file(sweep, results) or
                                          (results.is_file() and os.path.abspath(sweep) == os.path.abspath(results))):
        raise ValueError(f"--out: {results} is the lr-sweep results file this experiment reads "
                         f"({'--sweep' if options.sweep else 'the default --sweep OUT/../lr-sweep/results.jsonl'}); "
                         f"writing {experiment.name}'s results there would destroy them; use another --out")


REPORT_FILES = ("results.jsonl", "summary.json", "summary.md")  # beside the figures, named by each report


def _check_report_files(out: Path) -> None:
    """Before any work: each file the report writes in ``out`` (results, summaries, figures there) is a regular
    file or absent. A FIFO as results.jsonl blocked the check of its rows, opening it, for good (SIGTERM
    answered but never acted on: 10 minutes); a directory there failed only after the grid trained ("Is a
    directory")."""
    from ..train.plot import FIGURE_SUFFIXES

    try:
        names = [p.name for p in out.iterdir() if p.name in REPORT_FILES or p.suffix.lower() in FIGURE_SUFFIXES]
    except OSError:  # absent, or not a directory: make_directory names it
        return
    for name in sorted(names):
        kind = "a directory" if name in REPORT_FILES and (out / name).is_dir() else special_file(out / name)
        if kind is not None:
            raise ValueError(f"--out: {out / name} is {kind}, not a regular file, where the experiment writes its "
                             "report; move it away, or use another --out")


def _check_runs_directory(out: Path) -> None:
    """Before any work: OUT/runs, where every run of the grid is trained, is a directory or absent.
    A file (or a link to nothing) there made every run fail after the grid started, and the report
    then named a run directory that was never made instead of the file in the way."""
    runs = out / "runs"
    if os.path.lexists(runs) and not runs.is_dir():
        what = "a symbolic link to nothing" if runs.is_symlink() else "a file"
        raise ValueError(f"--out: {runs} is {what}, not the directory this experiment trains its runs in; move it "
                         "away, or use another --out")


_ROW_START = re.compile(r'\s*\{\s*"experiment"\s*:\s*"([^"\\]+)"')  # how every results row opens


def _owners(out: Path) -> set:
    """The experiments whose results or summary are in ``out`` ("another program" for files that
    are not an experiment's)."""
    owners = set()
    summary, results = out / "summary.json", out / "results.jsonl"
    if summary.is_file():
        try:
            owners.add(json.loads(summary.read_text(encoding="utf-8")).get("experiment", "another program"))
        except (OSError, ValueError, AttributeError):
            owners.add("another program")
    if results.is_file():
        try:
            lines = results.read_text(encoding="utf-8").splitlines()
        except (OSError, ValueError):
            owners.add("another program")
            return owners
        rows, bad = [], []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as e:
                bad.append((number, e))
                # A row cut short (by hand, by another tool) still opens with the experiment that wrote
                # it: a file of such rows alone is that experiment's, not "another program's".
                cut = _ROW_START.match(line)
                if cut:
                    rows.append({"experiment": cut.group(1)})
        named = {r.get("experiment") for r in rows if isinstance(r, dict)} - {None}
        if bad and named:  # an experiment's results with a line damaged (by hand): not another program's
            number, e = bad[0]
            raise ValueError(f"--out: {results} line {number} is not a JSON row ({e}); the rows there are "
                             f"{', '.join(sorted(named))}'s results: fix or remove that line and run again "
                             "(--overwrite would replace every row there)")
        owners |= {r.get("experiment", "another program") if isinstance(r, dict) else "another program"
                   for r in rows}
        if bad:
            owners.add("another program")
    return owners


def _result_runs(out: Path, name: str) -> list:
    """The run names of experiment ``name``'s rows in ``out/results.jsonl`` (lines that are not rows
    are :func:`_owners`' concern)."""
    try:
        lines = (out / "results.jsonl").read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError):
        return []
    runs = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("experiment") == name and isinstance(row.get("run"), str):
            runs.append(row["run"])
    return runs


def _check_out(experiment: Experiment, options: Options) -> None:
    """Before any work, with ``out`` locked: another experiment's results or summary, rows of runs
    this plan does not list (a rerun with fewer --seeds rewrote results.jsonl without them), and
    finished runs of this plan trained with other settings (a --quick grid into a full one), are
    refused unless ``options.overwrite``."""
    if options.overwrite:
        return
    out = Path(options.out)
    others = sorted(map(str, _owners(out) - {experiment.name}))
    if others:
        raise ValueError(f"--out: {out} holds the results of {', '.join(others)} (results.jsonl, summary.json), "
                         f"which {experiment.name} would replace; pass --overwrite to replace them, or use another "
                         "--out")
    plan = experiment.plan(options)
    # results.jsonl is rewritten from the plan: the rows of runs it does not list would go without a
    # word. An adaptive plan lists a run once what it depends on has finished, so a run killed before
    # the end hides the runs after it until it finishes again: its rows are not another configuration's.
    # Rows of runs never started ("not started", "missing") lose nothing: only trained ones count.
    unlisted = set(_result_runs(out, experiment.name)) - {r.name for r in plan}
    dropped = [] if experiment.adaptive else sorted(n for n in unlisted if read_status(out / "runs" / n) is not None)
    if dropped:
        raise ValueError(f"--out: {out / 'results.jsonl'} holds the rows of {len(dropped)} run(s) this plan does not "
                         f"list ({', '.join(dropped[:3])}{' ...' if len(dropped) > 3 else ''}: other --seeds or "
                         "options made them), which this experiment's results would drop; run it with the options "
                         "that made them, pass --overwrite to replace the results, or use another --out")
    changed, started, edited = [], [], []
    for run in plan:
        path = run_dir(out, run)
        if run.same_as is not None:
            continue
        if (read_status(path) or {}).get("status") in FINISHED:
            diffs = differences(path, run.train)
            if diffs:
                changed.append(f"{run.name} ({diffs[0]})")
        elif (path / FILENAME).is_file() and (path / "config.json").is_file():
            # Resumed only with the settings it was started with: another config.json (edited, or
            # another plan's) would start it over, its checkpoint and config.json replaced.
            diffs = differences(path, run.train)
            if diffs:
                started.append(f"{path / 'config.json'} ({diffs[0]})")
            elif edits := resume_edits(path):  # a setting the plan leaves alone, changed by hand: refused at resume
                edited.append(f"{path / 'config.json'} ({edits[0]})")
    if changed:
        raise ValueError(f"--out: {len(changed)} finished run(s) in {out / 'runs'} were trained with other settings "
                         f"than this plan's: {', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''}; pass "
                         "--overwrite to train them again, or use another --out")
    if started:
        raise ValueError(f"--out: {len(started)} unfinished run(s) with a checkpoint would be started over, their "
                         f"config.json differing from this plan's settings: {', '.join(started[:3])}"
                         f"{' ...' if len(started) > 3 else ''}; undo the change to resume them, pass --overwrite to "
                         "start them over, or use another --out")
    # A worker refuses to continue a checkpoint begun under other numerics (numerics.check_continues): said
    # here before any work, not as a failed run after the rest of the grid trained.
    current = numerics(GRID_THREADS)
    elsewhere = [f"{run_dir(out, r)} (begun under {began})" for r in plan if r.same_as is None
                 and (read_status(run_dir(out, r)) or {}).get("status") not in FINISHED
                 and (began := begun_under_other_numerics(run_dir(out, r), current)) is not None]
    if elsewhere:
        raise ValueError(f"--out: {len(elsewhere)} unfinished run(s) with a checkpoint began under other numerics than "
                         f"this machine's ({described(current)}), which round differently: "
                         f"{', '.join(elsewhere[:3])}{' ...' if len(elsewhere) > 3 else ''}; remove them (or move them "
                         "away) to train them again from their start, or use another --out")
    if edited:
        raise ValueError(f"--out: {len(edited)} unfinished run(s) with a checkpoint have a config.json changed since "
                         f"the run wrote it: {', '.join(edited[:3])}{' ...' if len(edited) > 3 else ''}; a resume "
                         "takes its settings from the plan and the checkpoint and would overwrite the change: undo it "
                         "(or remove the file) to resume them, pass --overwrite to start them over, or use another "
                         "--out")


def _check_run_files(out: Path, runs: list) -> None:
    """Before any work: each run's files (metrics.jsonl, status.json, config.json, its checkpoint) are regular
    files or absent. A FIFO as a finished run's metrics.jsonl blocked the check of its last step for good (killed
    after 40 s); a directory there failed the run only inside the grid."""
    for run in runs:
        for name in RUN_FILES:
            path = run_dir(out, run) / name
            kind = "a directory" if path.is_dir() else special_file(path)
            if kind is not None:
                raise ValueError(f"--out: {path} is {kind}, not a regular file, where the run {run.name} keeps its "
                                 f"{name}; move it away, or remove that run's directory to train it again")


def _check_finished_logs(out: Path, runs: list) -> None:
    """Before any work: a finished run of the plan whose metrics.jsonl no longer logs its last step
    (deleted or cut since it was written; a finished run is never trained again, --overwrite or not)
    is refused, naming the file and the step. The grid skipped the run, then its report drew a results
    row without a final loss: matplotlib's TypeError, "internal error", after the rest had trained.
    Only the last step: a thinned log (``benchmarks/thin_metrics.py`` keeps every run's last row and
    drops others; ``grid.restore_runs`` puts such runs back to go on from) is a finished run's as
    committed."""
    for run in runs:
        path = run_dir(out, run)
        status = read_status(path) or {}
        step = status.get("step")
        if run.same_as is not None or status.get("status") != "done" or not is_int(step) or step < 1 \
                or not is_finished(out, run):
            continue
        if not any(r["step"] == step for r in read_rows(path / "metrics.jsonl")):
            raise ValueError(f"--out: {path / 'metrics.jsonl'} holds no row for step {step}, the last of the "
                             f"finished run {run.name} (deleted or cut since the run wrote it), so its results "
                             "cannot be reported; put the file back, or remove that run's directory to train it "
                             "again")


def redraw(experiment: Experiment, src: Path, dst: Path, quick: bool = False) -> Report:
    """Copy an experiment's ``results.jsonl`` from ``src`` to ``dst`` and draw its report
    there with this code (figures, ``summary.md``, and ``summary.json`` with ``src``'s
    command, commit and machine): to publish a grid that is still running, or to redraw a
    committed one, without touching its runs. ``src``'s finished runs are archived in
    ``dst/runs`` (``grid.archive_runs``), so that a later session can restore them
    (``grid.restore_runs``) and go on with the rest of the grid. Refused before ``dst`` is written: rows of
    another experiment in ``src``, and a ``dst`` holding another experiment's results or summary."""
    options = Options(out=dst, quick=quick)  # first: quick=1 was refused by Options after dst was written
    src, dst = Path(src), options.out  # Options made dst a Path
    if not (src / "results.jsonl").is_file():
        raise ValueError(f"src: no results.jsonl in {src}")
    # Everything read and checked before dst is written: another experiment's rows were drawn as this one's
    # (norm-mode's report of qk-clip's variants), another experiment's results and summary in dst were replaced
    # without a word, and a summary.json that is no JSON failed with a bare JSONDecodeError after the archive.
    try:
        rows = read_results(src / "results.jsonl")
    except ValueError as e:
        raise ValueError(f"src: {src / 'results.jsonl'} is not JSON rows ({e})") from None
    others = sorted({str(r.get("experiment")) if isinstance(r, dict) else "another program" for r in rows}
                    - {experiment.name})
    if others:
        raise ValueError(f"src: {src / 'results.jsonl'} holds {', '.join(others)}'s results, not {experiment.name}'s")
    meta = {}
    if (src / "summary.json").is_file():
        try:
            meta = json.loads((src / "summary.json").read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"src: {src / 'summary.json'} is not JSON ({e}); remove it or fix it") from None
    meta = meta if isinstance(meta, dict) else {}
    if dst.is_dir():
        try:
            owners = _owners(dst) - {experiment.name}
        except ValueError as e:
            raise ValueError(f"dst: {str(e).removeprefix('--out: ')}") from None
        if owners:
            raise ValueError(f"dst: {dst} holds {', '.join(sorted(owners))}'s results or summary, which redrawing "
                             f"{experiment.name} there would replace; redraw into another directory")
    dst.mkdir(parents=True, exist_ok=True)
    if same_file(src, dst):
        raise ValueError(f"dst: {dst} is src; redraw into another directory")
    archive_runs(src, dst, experiment.thin_metrics)
    write_results(rows, dst / "results.jsonl")
    report = experiment.report(rows, options)
    keep = ("experiment", "command", "commit", "machine", "runs", "cpu_seconds_of_runs", "errors")
    meta = {k: meta[k] for k in keep if k in meta}
    meta["redrawn_at_commit"] = source_commit(Path(__file__).parent)
    meta["figures"] = figure_names(report)
    write_text(dst / "summary.json", json.dumps({**meta, **report.summary}, indent=1))
    write_text(dst / "summary.md", report.table)
    return report


def _pending(out: Path, run: Run, measure) -> bool:
    """Not trained yet, or trained and not yet measured."""
    return not is_finished(out, run) or (measure is not None and not (run_dir(out, run) / "measure.json").is_file())


def _write_stopped_report(experiment: Experiment, options: Options, runs: list[Run], stop, command, t0,
                          statuses: Optional[dict] = None) -> None:
    """The rows (and the report, if it can be drawn) of a grid stopped by a signal
    (:class:`GridStopped`) or a machine error (:class:`GridFailed`): every run that ended before
    the stop has its row. A machine error that also keeps them from being written (the same full
    disk) leaves the stop's own error to be reported, the first one met."""
    try:
        _write_report(experiment, options, runs, stop.statuses if statuses is None else statuses, command, t0,
                      stopped=True)
    except OSError:
        if not isinstance(stop, GridFailed):
            raise


def figure_names(report: Report) -> list[str]:
    """The names of the figures the report drew in its directory, recorded in summary.json: qkmla plot
    refuses to replace those, and replaces any other figure there that it drew itself."""
    return [Path(f).name for f in report.figures if f is not None]


def _write_report(experiment: Experiment, options: Options, runs: list[Run], statuses: dict, command, t0,
                  stopped: bool = False) -> Optional[Report]:
    """``results.jsonl`` (one row per planned run, trained or not), figures and summaries.
    ``stopped``: the grid was stopped (by a signal or a machine error), so its runs resume on the
    next call: a report that cannot be drawn from the unfinished runs is left for that call (None),
    not refused."""
    out = options.out
    rows = [summarize(experiment.name, r, out) for r in runs]
    write_results(rows, out / "results.jsonl")
    try:
        report = experiment.report(read_results(out / "results.jsonl"), options)
    except (TypeError, ValueError, KeyError, ZeroDivisionError, IndexError):
        unfinished = [r for r in rows if r["status"] not in FINISHED]
        if not unfinished:
            raise
        if stopped:
            return None
        first = unfinished[0]
        why = (statuses.get(first["run"]) or {}).get("error") or first.get("error") or f"status {first['status']!r}"
        raise ValueError(f"--out: {len(unfinished)} run(s) of {len(rows)} did not finish, so the report cannot be "
                         f"drawn (its rows are in {out / 'results.jsonl'}); {first['run']}: {why}; fix or remove "
                         f"{run_dir(out, runs[[r.name for r in runs].index(first['run'])])} and run again") from None
    meta = {"experiment": experiment.name, "command": command, "commit": source_commit(Path(__file__).parent),
            "machine": machine(), "runs": len(runs),
            "runs_trained_now": len(statuses), "wall_seconds_now": time.perf_counter() - t0,
            "cpu_seconds_of_runs": sum(r["seconds"] or 0 for r in rows if not r.get("same_as")),
            "errors": [r["run"] for r in rows if r["status"] not in ("done", "non-finite", "missing")],
            "figures": figure_names(report)}
    write_text(out / "summary.json", json.dumps({**meta, **report.summary}, indent=1))
    write_text(out / "summary.md", report.table)
    return report
