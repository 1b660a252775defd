"""Environment variables qkmla reads, checked before any work: one line naming the variable.

* ``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS`` that are not a positive int: OpenMP reads them once,
  when torch loads it, prints its own complaint and uses its default. ``import qkmla`` imports
  torch, so a process running qkmla's command line (``python -m qkmla``, ``python -m qkmla.train``,
  the ``qkmla`` script) drops them first thing in ``qkmla/__init__.py``
  (:func:`prepare_command_line`), with one line naming the variable and no
  complaint from OpenMP. ``main()`` checks them again for a caller in a Python of its own (a test,
  a notebook), where torch is usually loaded already: its line is the same, but OpenMP has read
  the variable by then.
* torchrun's ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``: each must be an int
  in range (``RANK < WORLD_SIZE``), and ``MASTER_PORT`` a TCP port where there are several ranks,
  or the command is refused naming it.
* ``qkmla experiment`` and ``qkmla demo`` run as one process (their runs train in processes of
  their own): any ``WORLD_SIZE > 1`` is refused for them, under torchrun too.
* The same variables left in a shell after a torchrun job (stale): a process not started by
  torchrun (no ``TORCHELASTIC_RUN_ID``) that sees ``WORLD_SIZE > 1`` would wait for ranks that
  never come. :func:`check_launch` refuses that, naming the variables to unset.
* qkmla's own switches (:data:`SWITCHES`, ``QKMLA_CPU_KERNEL``): 0 or 1 (empty: the default);
  anything else ("off", "false") is refused naming the variable, where it was read as "on".
* torch's ``ATEN_CPU_CAPABILITY`` (which instruction set its CPU kernels use, and so how a run
  rounds: ``qkmla.experiments.numerics``): on x86, ``default``, ``avx2`` or ``avx512``, and one
  this CPU has. torch ignores anything else with a warning per process, and takes ``avx512`` on a
  CPU without AVX-512 at its word: the first kernel stopped the process with an illegal
  instruction (exit 132, not a word). :func:`check_cpu_capability` refuses both, naming it.
* transformers' ``TRANSFORMERS_VERBOSITY``: one of its log levels (:data:`TRANSFORMERS_LEVELS`), as
  it spells them (lower case); empty is unset to it too. transformers ignores anything else with a
  warning of its own, printed when a command first imports it (``convert``, ``generate --hf``), mid-
  command and unnamed by qkmla. :func:`check_transformers_verbosity` refuses it, naming it, before any
  work (as ``ATEN_CPU_CAPABILITY``, which torch ignores the same way): the user asked for a verbosity
  and would not get it. For every command, also those that never import transformers: the variable is
  the same junk there, and a shell that sets it for one command sets it for the next.
* ``CUDA_VISIBLE_DEVICES`` needs no check here: whatever it holds, torch sees the accelerators
  it leaves, and ``--device`` is checked against those.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
DIST_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


SWITCHES = {"QKMLA_CPU_KERNEL": (True, "the C++ CPU kernels of qkmla.ops.cpu_extension")}


def switch(name: str) -> bool:
    """The value of qkmla's switch ``name`` (:data:`SWITCHES`): "1" on, "0" off, unset or empty its
    default.

    Raises:
        ValueError naming the variable for any other value.
    """
    default, what = SWITCHES[name]
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}: the environment variable holds {os.environ[name]!r}, expected 0 (turns off {what}) "
                         f"or 1 (on); unset it for the default ({int(default)})")
    return value == "1"


def check_switches() -> None:
    """Every switch of :data:`SWITCHES` read once, before any work: junk is refused up front."""
    for name in SWITCHES:
        switch(name)


CPU_CAPABILITIES = {"default": None, "avx2": "_is_avx2_supported", "avx512": "_is_avx512_supported"}  # x86's


def check_cpu_capability() -> None:
    """``ATEN_CPU_CAPABILITY``, if set on x86, is one of :data:`CPU_CAPABILITIES` that this CPU
    has (module docstring); a ValueError naming it otherwise. Call it before the first kernel runs:
    torch reads the variable then, once."""
    import platform

    value = os.environ.get("ATEN_CPU_CAPABILITY")
    # empty, as `VAR= command` or an env file's blank line leaves it: unset to torch too (it picks the best)
    if not value or platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return  # other CPUs have other values (vsx, zvector, sve256): torch's to judge
    allowed = ", ".join(CPU_CAPABILITIES)
    if value not in CPU_CAPABILITIES:
        raise ValueError(f"ATEN_CPU_CAPABILITY: the environment variable holds {value!r}, which torch ignores; "
                         f"expected one of {allowed}, or unset it (torch picks this CPU's best)")
    import torch

    has = getattr(torch.cpu, CPU_CAPABILITIES[value] or "", None)  # cpuinfo's flags, not the variable
    if has is not None and not has():
        usable = ", ".join(c for c, f in CPU_CAPABILITIES.items() if f is None or getattr(torch.cpu, f, bool)())
        raise ValueError(f"ATEN_CPU_CAPABILITY: the environment variable holds {value!r}, an instruction set this "
                         f"CPU lacks (torch's kernels for it would stop the process with an illegal instruction); "
                         f"expected one of {usable} here, or unset it (torch picks this CPU's best)")


# transformers.utils.logging's log_levels, in its order (read from its source: importing transformers to ask
# would take seconds on every command, and print its own warning for the junk this refuses)
TRANSFORMERS_LEVELS = ("detail", "debug", "info", "warning", "error", "critical")


def check_transformers_verbosity() -> None:
    """``TRANSFORMERS_VERBOSITY``, if set and not empty, is one of :data:`TRANSFORMERS_LEVELS`; a
    ValueError naming it otherwise (module docstring)."""
    value = os.environ.get("TRANSFORMERS_VERBOSITY")
    if value and value not in TRANSFORMERS_LEVELS:
        hint = f" (transformers reads them in lower case: {value.strip().lower()})" \
            if value.strip().lower() in TRANSFORMERS_LEVELS else ""
        raise ValueError(f"TRANSFORMERS_VERBOSITY: the environment variable holds {value!r}, which transformers "
                         f"ignores; expected one of {', '.join(TRANSFORMERS_LEVELS)}{hint}, or unset it")


def agg_matplotlib():
    """matplotlib, with the Agg backend every qkmla figure is drawn with (off-screen, to a file).
    ``MPLBACKEND`` is set aside while matplotlib is first imported, which validates it: qkmla selects
    Agg whatever it holds, so it is read by nothing here, yet a junk value ("MPLBACKEND=junk", one
    left from a desktop session) failed plot, demo and every experiment's report as "Key backend:
    'junk' is not a valid value for backend; ...", naming no variable. The variable is put back."""
    if "matplotlib" not in sys.modules:
        saved = os.environ.pop("MPLBACKEND", None)
        try:
            import matplotlib
        finally:
            if saved is not None:
                os.environ["MPLBACKEND"] = saved
    import matplotlib

    matplotlib.use("Agg")
    return matplotlib


def drop_bad_thread_counts(command: str) -> list[str]:
    """Remove OMP_NUM_THREADS / MKL_NUM_THREADS values that are not positive ints (a list such
    as "4,2" is OpenMP's nested form: kept), saying so on stderr; returns the names dropped.
    Call it before torch is imported."""
    dropped = []
    for name in THREAD_VARIABLES:
        value = os.environ.get(name)
        if value is None:
            continue
        parts = value.strip().split(",")
        if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            del os.environ[name]
            dropped.append(name)
            # --threads, where given, decides after this; "torch's default is used" misled there (probe 8).
            print(f"qkmla {command}: {name}={value!r} is not a positive number of threads; ignored (--threads, or "
                  "torch's default, decides)", file=sys.stderr)
    return dropped


def command_line_name(argv: Optional[list] = None) -> Optional[str]:
    """The subcommand this process runs when it is qkmla's command line, read from the original
    command line (``sys.orig_argv``: the module ``-m`` names is known before it runs): "train" for
    ``python -m qkmla.train ...``, COMMAND for ``python -m qkmla COMMAND ...`` or ``qkmla COMMAND
    ...`` (the console script); None for any other program (a script or test importing qkmla), or
    no subcommand given."""
    argv = list(getattr(sys, "orig_argv", ()) if argv is None else argv)
    rest, i = None, 1
    while i < len(argv):  # the interpreter's options, up to what it runs
        arg = argv[i]
        if arg == "--check-hash-based-pycs":  # the one long option with a value
            i += 2
            continue
        if arg == "-":  # the program from stdin: not the command line
            return None
        if arg.startswith("-") and not arg.startswith("--"):
            # Short options combine (-Bm MODULE, -OOc CODE, -Wd): the first of c, m, W, X takes the
            # rest of the word as its value, or the next word.
            letters = arg[1:]
            at = next((j for j, letter in enumerate(letters) if letter in "cmWX"), None)
            if at is None:
                i += 1
                continue
            letter, value = letters[at], letters[at + 1:]
            if letter == "c":  # code: not the command line
                return None
            if letter in "WX":
                i += 1 if value else 2
                continue
            if not value and i + 1 >= len(argv):
                return None
            module, rest = (value, argv[i + 1:]) if value else (argv[i + 1], argv[i + 2:])
            if module == "qkmla.train":
                return "train"
            rest = rest if module == "qkmla" else None
            break
        if not arg.startswith("-"):  # a script: the console script is called qkmla
            rest = argv[i + 1:] if os.path.basename(arg).split(".")[0] in ("qkmla", "qkmla-script") else None
            break
        i += 1
    return next((a for a in rest if not a.startswith("-")), None) if rest else None


def prepare_command_line() -> None:
    """For qkmla's command line, before torch is imported (called first thing by
    ``qkmla/__init__.py``): :func:`drop_bad_thread_counts`, and Ctrl-C as one line until the
    command starts (``startup.py``); a program that only imports qkmla is left alone."""
    command = command_line_name()
    if command is not None:
        from .startup import quiet_interrupts_at_startup

        quiet_interrupts_at_startup(command)  # a Ctrl-C or SIGTERM while torch loads: one line
        drop_bad_thread_counts(command)


def _int_variable(name: str, low: int, default: Optional[int]) -> Optional[int]:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        n = int(value.strip())
    except ValueError:
        n = None
    if n is None or n < low:
        raise ValueError(f"{name}: the environment variable holds {value!r}, expected an int >= {low} (set by "
                         f"torchrun); unset it, or launch with torchrun")
    return n


def dist_environment() -> tuple[int, int, int]:
    """(world size, rank, local world size) from torchrun's variables, each checked.

    Raises:
        ValueError naming the variable: not an int, out of range, or RANK >= WORLD_SIZE.
    """
    world = _int_variable("WORLD_SIZE", 1, 1)
    rank = _int_variable("RANK", 0, 0)
    local_rank = _int_variable("LOCAL_RANK", 0, 0)
    local = _int_variable("LOCAL_WORLD_SIZE", 1, 1)
    if rank >= world:
        raise ValueError(f"RANK: the environment variable holds {rank}, but WORLD_SIZE is {world} (ranks 0..{world - 1}); "
                         "unset them, or launch with torchrun")
    # A LOCAL_WORLD_SIZE left from a torchrun job would divide --threads auto among ranks that
    # do not exist (a stale 4 gave one process a quarter of its cores, as "4 ranks").
    if local > world:
        raise ValueError(f"LOCAL_WORLD_SIZE: the environment variable holds {local}, more than the WORLD_SIZE of "
                         f"{world} ranks; unset it, or launch with torchrun")
    if "LOCAL_WORLD_SIZE" in os.environ and local_rank >= local:  # a launcher may set LOCAL_RANK alone
        raise ValueError(f"LOCAL_RANK: the environment variable holds {local_rank}, but LOCAL_WORLD_SIZE is {local} "
                         f"(local ranks 0..{local - 1}); unset them, or launch with torchrun")
    if world > 1 and "MASTER_PORT" in os.environ:  # read by torch's rendezvous as int(...), unnamed in its error
        port = os.environ["MASTER_PORT"]
        if not (port.strip().isascii() and port.strip().isdigit()) or not 0 <= int(port) <= 65535:
            raise ValueError(f"MASTER_PORT: the environment variable holds {port!r}, expected a TCP port, an int "
                             "from 0 to 65535 (set by torchrun); unset it, or launch with torchrun")
    return world, rank, local


def check_hash_seed() -> None:
    """``PYTHONHASHSEED``, which every Python this process starts reads as it starts (``qkmla experiment``'s
    workers): "random" or a decimal int from 0 to 4294967295 (empty: unset), as Python takes it. Anything
    else stops each worker at its start ("Fatal Python error: ... PYTHONHASHSEED must be ..."), and the grid
    ended in a broken pool's traceback and "internal error". (A ``qkmla`` started with it never runs: Python
    refuses it first; a caller's ``os.environ`` can hold it still.)

    Raises:
        ValueError naming the variable."""
    import re

    value = os.environ.get("PYTHONHASHSEED")
    if not value or value == "random":
        return
    match = re.fullmatch(r"[ \t\n\v\f\r]*([+-]?)([0-9]+)", value)  # C's strtoul, which Python parses it with
    if match is None or (int(match[2]) != 0 and match[1] == "-") or int(match[2]) > 4294967295:
        raise ValueError(f"PYTHONHASHSEED: the environment variable holds {value!r}, which every Python started "
                         "from here (the worker processes) refuses at its start; expected \"random\" or an int from 0 "
                         "to 4294967295, or unset it")


def check_launch(command: str = "train") -> None:
    """For a command line: refuse torchrun variables that no torchrun set (``qkmla train``), and
    any WORLD_SIZE > 1 for a command that runs as one process (``qkmla experiment`` and ``qkmla
    demo`` train through their own processes, one run each: under torchrun every rank waited in
    the rendezvous or a collective for ranks that never come, deaf to SIGTERM while it waited).

    Raises:
        ValueError naming the variables: WORLD_SIZE > 1 in a process torchrun did not start
        (it would wait for the other ranks forever), or in one that ``command`` cannot use.
    """
    world, _, _ = dist_environment()
    if world > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        stale = " ".join(n for n in DIST_VARIABLES if n in os.environ)
        raise ValueError(f"WORLD_SIZE: the environment says {world} ranks, but this process was not started by "
                         f"torchrun (no TORCHELASTIC_RUN_ID): variables left from an earlier job? `unset {stale}`, "
                         "or launch with `torchrun --nproc_per_node N -m qkmla.train ...`")
    if world > 1 and command != "train":
        stale = " ".join(n for n in DIST_VARIABLES + ("TORCHELASTIC_RUN_ID",) if n in os.environ)
        raise ValueError(f"WORLD_SIZE: the environment says {world} ranks, but qkmla {command} runs as one process "
                         f"(its runs train one process each), not under torchrun; `unset {stale}`, or train one "
                         "run under torchrun with `torchrun --nproc_per_node N -m qkmla.train ...`")
