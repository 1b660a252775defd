"""The ``qkmla`` command: verify, cache-size, train, plot, generate, convert, convert-gqa and demo."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

from ..cache.size import CACHE_PRESETS, DENSE_KV_DTYPES, DTYPE_BYTES, KV_DTYPES, cache_rows, format_table
from ..utils.checked import is_int
from ..utils.command import option_dests, run_command
from ..utils.errors import Parser, one_line
from ..utils.threads import add_threads_argument

# Named here for --help without importing torch; tests check them against
# qkmla.kv_formats.KV_FORMATS and qkmla.cache.eviction.POLICIES.
GENERATE_KV_FORMATS = ("dense", "fp8", "int8", "int4")
GENERATE_POLICIES = ("streaming-llm", "h2o", "snapkv")


def _verify(args: argparse.Namespace) -> int:
    from ..utils.checked import check_seed
    from . import verify, verify_quantized

    check_seed("--seed", args.seed)
    # A flag given twice names its rows once (--variant X --variant X computed and printed X twice).
    args.variant = list(dict.fromkeys(args.variant)) if args.variant else args.variant
    args.kv_format = list(dict.fromkeys(args.kv_format)) if args.kv_format else args.kv_format
    names = args.variant or list(verify.VARIANTS)
    unknown = [n for n in names if n not in verify.VARIANTS]
    if unknown:
        raise ValueError(f"--variant: unknown {unknown}; allowed: {list(verify.VARIANTS)}")
    # --variant alone: the Appendix E rows; --kv-format alone: the quantized-cache rows; neither: both.
    rows = [] if args.kv_format and not args.variant else \
        [row for n in names for row in verify.verify_variant(n, verify.VARIANTS[n], seed=args.seed)]
    formats = args.kv_format or ([] if args.variant else list(verify_quantized.FORMATS))
    quant_names = args.variant or verify_quantized.QUANT_VARIANTS
    quant = [verify_quantized.verify_quantized(n, f, seed=args.seed) for f in formats for n in quant_names]
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows + quant], indent=1))
    else:
        print("\n\n".join(table for table, shown in ((verify.format_rows(rows), rows),
                                                     (verify_quantized.format_rows(quant), quant)) if shown))
    failed = [f"{r.variant}/{r.dtype}" for r in rows if not r.ok] + \
        [f"{r.variant}/{r.kv_format}" for r in quant if not r.ok]
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


_SHAPE_FLAGS = ("num_layers", "num_heads", "head_dim", "num_kv_heads", "kv_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "num_kv_groups")


def _cache_size(args: argparse.Namespace) -> int:
    from ..cache.size import CacheShape

    flags = {f: getattr(args, f) for f in _SHAPE_FLAGS}
    flags.update(dtype=args.dtype, scalar_dtype=args.scalar_dtype)
    if args.kv_dtype in DENSE_KV_DTYPES:  # a dense cache in that dtype: --dtype by another name
        if args.dtype not in (None, args.kv_dtype):
            raise ValueError(f"--kv-dtype: {args.kv_dtype} is a dense cache in that dtype, which contradicts "
                             f"--dtype {args.dtype}; give one of them")
        flags["dtype"] = args.kv_dtype
    elif args.kv_dtype is not None:
        flags["kv_format"] = args.kv_dtype
    if args.preset is not None:
        preset, heads = CACHE_PRESETS[args.preset], flags["num_heads"]
        # The preset's KV heads (its GQA row) and KV groups are its own, not the user's: "--num-kv-heads: must
        # divide num_heads=7, got 8" named an option never given.
        for field in ("num_kv_heads", "num_kv_groups"):
            given = getattr(preset, field)
            if flags[field] is None and is_int(heads) and 0 < heads < 2**63 and is_int(given) and heads % given:
                raise ValueError(f"--num-heads: {heads} is not a multiple of the preset {args.preset}'s {field} "
                                 f"{given}; give {_flag(field)} too, a divisor of {heads}")
        shape, title = preset.replace(**flags), args.preset
    else:
        missing = [f"--{f.replace('_', '-')}" for f in ("num_layers", "num_heads", "head_dim") if flags[f] is None]
        if missing:
            raise ValueError(f"give --preset (one of {sorted(CACHE_PRESETS)}) or {', '.join(missing)}")
        if flags["num_kv_heads"] is None:
            flags["num_kv_heads"] = flags["num_heads"]
        flags["dtype"] = flags["dtype"] or "bf16"
        shape, title = CacheShape(**{k: v for k, v in flags.items() if v is not None}), "custom"
    rows = cache_rows(shape, args.tokens)
    if args.json:
        print(json.dumps({"preset": title, "shape": dataclasses.asdict(shape), "rows": rows}, indent=1))
    else:
        print(format_table(shape, rows, title))
    return 0


def _train(args: argparse.Namespace) -> int:
    from ..train.cli import run_train

    return run_train(args)


def _flag(name: str) -> str:
    """The command-line flag of a Python API argument: kept_fraction -> --kept-fraction."""
    return f"--{name.replace('_', '-')}"


def _as_options(error: ValueError, names: dict[str, str]) -> ValueError:
    """``error`` with the Python API's argument name that leads it as this command's option
    (``names``: API name -> option), so a refusal names what the user typed."""
    name, _, rest = str(error).partition(": ")
    return ValueError(f"{names.get(name, name)}: {rest}")


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..utils.files import check_output, check_path
    from ..train.plot import FIGURE_SUFFIXES, PlotWarning, check_figure_name, plot_runs

    check_path("--out", args.out, "figure file")
    for run in args.runs:
        check_path("runs", run, "run directory")
    inputs = [f for run in args.runs if Path(run).is_dir() for f in Path(run).iterdir() if f.is_file()]
    check_output("--out", [args.out], inputs, args.overwrite, "figure", FIGURE_SUFFIXES)
    check_figure_name("--out", args.out)  # after the refusals that name a file of the user's in the way
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlotWarning)
        try:
            path = plot_runs(args.runs, args.out)
        except ValueError as e:
            raise _as_options(e, {"run_dir": "runs"}) from None
    for w in caught:  # the steps and curves a figure leaves out, one line each, as the command's own messages
        if issubclass(w.category, PlotWarning):
            print(f"qkmla plot: warning: {one_line(str(w.message))}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    print(f"wrote {path}")
    return 0


def _policy(args: argparse.Namespace):
    """The eviction policy ``--policy`` with ``--budget`` / ``--kept-fraction`` names, or None."""
    from ..cache.eviction import POLICIES, make_policy

    if args.policy is not None:
        if args.policy not in POLICIES:
            raise ValueError(f"--policy: expected one of {tuple(POLICIES)}, got {args.policy!r}")
        if (args.budget is None) == (args.kept_fraction is None):
            raise ValueError("--policy: needs exactly one of --kept-fraction or --budget, got "
                             f"{'both' if args.budget is not None else 'neither'}")
        size = {"budget": args.budget} if args.budget is not None else {"kept_fraction": args.kept_fraction}
        if args.window is not None:
            if args.policy == "streaming-llm":
                raise ValueError("--window: streaming-llm keeps the newest tokens by definition (its window is "
                                 "the budget less the sinks); --window sets h2o's and snapkv's protected window")
            size["window"] = args.window
        if args.sinks is not None:
            size["sinks"] = args.sinks
        return make_policy(args.policy, **size)
    for flag in ("budget", "kept_fraction", "window", "sinks"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag.replace('_', '-')}: sizes an eviction policy; give --policy too "
                             f"(one of {tuple(POLICIES)})")
    return None


def _text_stream(tok):
    """stream(id) -> the text that token adds (a byte tokenizer's multi-byte characters come out
    whole, once their last byte is in); stream(None) -> what is left at the end."""
    if tok.kind != "byte":
        return lambda i: "" if i is None else tok.decode([i])
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return lambda i: decoder.decode(b"", final=True) if i is None else decoder.decode(bytes([i]))


def _kept_line(policy, report: dict) -> str:
    """What the policy really kept, per sequence, at the end of generation."""
    kept, seen = report["kept"], report["seen"]
    pairs = ", ".join(f"{k} of {n}" for k, n in zip(kept, seen))
    asked = f"--budget {policy.budget}" if policy.budget is not None else f"--kept-fraction {policy.kept_fraction:g}"
    window = str(policy.window)
    if policy.name == "streaming-llm":
        # Its window is every token it keeps past the sinks (the newest); policy.window is only the newest token
        # it always keeps, and "window 1" was reported for a cache holding the 12 newest (--budget 16, sinks 4)
        newest = list(dict.fromkeys(max(0, k - policy.sinks) for k in kept))
        window = ", ".join(map(str, newest)) + (" (per cache)" if len(newest) > 1 else "")
    return (f"{policy.name} ({asked}, sinks {policy.sinks}, window {window}) kept {pairs} tokens seen "
            f"per cache at the end ({sum(kept) / max(1, sum(seen)):.0%})")


def _hf_dtype(hf_dir: str, allowed) -> str:
    """The dtype a --hf checkpoint is loaded in without ``--dtype``: the one its config.json
    records (``dtype``, or ``torch_dtype`` before transformers 5), float32 if none. The file is
    read as every command reads it (``read_hf_config``: a regular file, UTF-8 JSON), its errors
    naming --hf: read here with its own ``read_text``, a config.json that was not UTF-8 was
    reported as the codec's bare message, and a FIFO by that name hung the command."""
    from pathlib import Path

    from ..integrations.hub.checkpoint import read_hf_config

    path = Path(hf_dir) / "config.json"
    if not os.path.lexists(path):  # the loader says what is missing, as it did ("has no config.json")
        return "float32"
    try:
        config = read_hf_config(hf_dir)
    except ValueError as e:
        raise _as_options(e, {"hf_dir": "--hf"}) from None
    recorded = config.get("dtype") or config.get("torch_dtype")
    if recorded is None:
        return "float32"
    if recorded not in allowed:
        raise ValueError(f"--dtype: {path} records dtype {recorded!r}, which --hf does not load in; give --dtype, one "
                         f"of {tuple(allowed)}")
    return recorded


def _tokens_flag(argv: Sequence[str]) -> str:
    """The name the new-token count was given by, for messages: ``--tokens`` is ``--max-new-tokens``' other name."""
    return "--tokens" if any(a == "--tokens" or a.startswith("--tokens=") for a in argv) else "--max-new-tokens"


def _generate_hf(args: argparse.Namespace, policy) -> int:
    from ..integrations.transformers.generate import DTYPES, generate_hf
    from ..utils.devices import check_device

    device = check_device("--device", args.device)  # the CPU, or an accelerator this machine has
    dtype = args.dtype if args.dtype is not None else _hf_dtype(args.hf, DTYPES)
    try:
        # The device as torch's default for what is made inside: transformers loads the weights there
        # (its device_map when none is given) and the prompts' batch is made there.
        with device:
            texts = generate_hf(args.hf, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
                                args.kv_format, policy, dtype, option=_flag)
    except ValueError as e:
        raise _as_options(e, {"hf_dir": "--hf", "max_new_tokens": _tokens_flag(args.argv), "prompts": "--prompt"}) \
            from None
    for text in texts:
        print(text)
        print("-" * 40)
    return 0


def _warn_config_edits(run) -> None:
    """The model is built from the settings its checkpoint carries, never from RUN/config.json, the run's
    record of them; a hand edit there (model.n_head 3) was read by nothing without a word (probe14 G17),
    where a resume over it is refused. Generating reads the checkpoint alone, so the edit is said, not refused."""
    from ..train.checkpoint import FILENAME, read_metadata
    from ..train.rundir import foreign_checkpoint, resume_edits, written_digests

    try:
        recorded = json.loads(read_metadata(Path(run) / FILENAME)["config"])
    except (OSError, ValueError, KeyError, TypeError):  # loaded already, so readable: a caller's own file
        recorded = None
    # A checkpoint copied in from another run (its settings differ from those the config.json qkmla wrote here
    # records) was sampled without a word, as if it were this run's
    foreign = foreign_checkpoint(Path(run) / "config.json", recorded, written_digests(Path(run))) if recorded else []
    if foreign:
        print(one_line(f"qkmla generate: warning: {Path(run) / FILENAME} is another run's checkpoint than the one "
                       f"{Path(run) / 'config.json'} records ({'; '.join(foreign[:3])}"
                       f"{'; ...' if len(foreign) > 3 else ''}); sampling from the checkpoint's model"),
              file=sys.stderr)
        return
    # The settings that may change on a resume (RESUMABLE: lr, steps, the schedule) and the data are not the
    # model's, and the warning says the model is the checkpoint's; every other edit is said (TrainConfig's
    # other fields, attn, preset, block_size, define the model).
    from ..train.config import RESUMABLE

    edits = [e for e in resume_edits(Path(run)) if not e.startswith(("data:", "data."))
             and not any(e.startswith(f"train.{name}:") for name in RESUMABLE)]
    if edits:
        print(one_line(f"qkmla generate: warning: {Path(run) / 'config.json'} was changed since the run wrote it "
                       f"({'; '.join(edits[:3])}{'; ...' if len(edits) > 3 else ''}); the model is the one its "
                       f"checkpoint describes, not this file's"), file=sys.stderr)


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from ..kv_formats import check_kv_format
    from ..model.generate import check_sampling, generate
    from ..utils.checked import check_seed
    from ..utils.files import check_path
    from ..utils.threads import apply_threads

    tokens_flag = _tokens_flag(args.argv)
    check_sampling(args.max_new_tokens, args.temperature, args.top_k, names=(tokens_flag, "--temperature", "--top-k"))
    check_seed("--seed", args.seed)
    for prompt in args.prompt:  # the shell passes bytes: one that is not UTF-8 is a surrogate no tokenizer takes
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            bad = os.fsencode(prompt[e.start:e.end])
            raise ValueError(f"--prompt: {prompt!r} is not UTF-8 text (byte {bad[:1]!r} at character {e.start}); "
                             "give the prompt in UTF-8") from None
    if (args.run is None) == (args.hf is None):
        raise ValueError("run: give either a qkmla run directory or --hf DIR (a transformers checkpoint); got "
                         f"{'both' if args.run else 'neither'}")
    for flag, path in (("run", args.run), ("--hf", args.hf)):
        if path is not None:
            check_path(flag, path, "directory")
    if args.run is not None and Path(args.run).is_file() and not args.run.endswith(".safetensors"):
        # A text file given as the run was reported as a "truncated or corrupt" checkpoint.
        raise ValueError(f"run: {args.run} is a file; expected a run directory (with checkpoint.safetensors), as "
                         "qkmla train writes")
    policy = _policy(args)
    check_kv_format(args.kv_format)
    apply_threads(args.threads, "generate")
    for flag, what in (("dtype", "the dtype a --hf checkpoint is loaded in; a qkmla run keeps its own"),
                       ("device", "where a --hf checkpoint runs; a qkmla run is sampled on the CPU")):
        if getattr(args, flag) is not None and args.hf is None:
            raise ValueError(f"--{flag}: sets {what}")
    if args.hf is not None:
        if args.device is None:
            args.device = "cpu"
        return _generate_hf(args, policy)
    from ..cache.eviction import check_kept_fraction
    from ..utils.limits import check_fits
    from ..model.generate import max_tokens_seen
    from ..train.trainer import load_model

    # Every generated token is held until it is printed (its id, the Python int and the text):
    # 48 bytes is a lower bound per token.
    check_fits(tokens_flag, 48 * args.max_new_tokens * len(args.prompt),
               f"{args.max_new_tokens} new tokens for each of {len(args.prompt)} prompt(s)")
    if any(not p for p in args.prompt):
        raise ValueError("--prompt: expected text to continue, got an empty prompt")
    try:
        model, tok = load_model(args.run)
    except ValueError as e:
        raise _as_options(e, {"run_dir": "run"}) from None
    _warn_config_edits(args.run)
    try:
        prompts = [tok.encode(p) for p in args.prompt]
    except ValueError as e:
        raise ValueError(f"--prompt: {str(e).partition(': ')[2]}") from None
    if policy is not None:
        check_kept_fraction(policy, max_tokens_seen(model, prompts, args.max_new_tokens, policy.interval is None),
                            option=_flag)
    gen = torch.Generator().manual_seed(args.seed)
    report = {}
    stream = on_token = None
    if len(prompts) == 1:  # one prompt: its text is printed as it comes, so a long run shows its progress
        stream, echoed = _text_stream(tok), []

        def on_token(ids):
            # The prompt is echoed with the first token, not before generate(): its caches are made
            # there, and a refusal of them (--kv-format int8 for a GQA run) came after the prompt
            # was already on stdout, for a script reading it to take as the start of the output.
            if not echoed:
                echoed.append(print(args.prompt[0], end=""))
            print(stream(ids[0]), end="", flush=True)
    outs = generate(model, prompts, args.max_new_tokens, args.temperature, args.top_k, gen, progress=stream is None,
                    policy=policy, kv_format=args.kv_format, report=report, on_token=on_token)
    if stream is not None:
        print(stream(None))
        print("-" * 40)
    for p, o in zip(args.prompt, outs) if stream is None else ():
        print(p + tok.decode(o))
        print("-" * 40)
    if policy is not None:
        print(_kept_line(policy, report), file=sys.stderr)
    return 0


# The flags that make one QKNormConfig, by its field names.
QK_NORM_FLAGS = {"kind": "--qk-norm", "mode": "--qk-norm-mode", "p": "--qk-norm-p"}


def _qk_norm_from_flags(args: argparse.Namespace):
    """The QKNormConfig ``--qk-norm``, ``--qk-norm-mode`` and ``--qk-norm-p`` give (None without
    ``--qk-norm``), checked; a refusal names the flag."""
    from ..config import QKNormConfig

    fields = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in QK_NORM_FLAGS.items()}
    if fields["kind"] is None:
        given = [QK_NORM_FLAGS[f] for f in ("mode", "p") if fields[f] != getattr(QKNormConfig, f)]
        if given:
            raise ValueError(f"{given[0]}: only read with a qk_norm; give --qk-norm too")
        return None
    try:
        norm = QKNormConfig(**fields)
    except ValueError as e:
        field, _, rest = str(e).partition(": ")
        raise ValueError(f"{QK_NORM_FLAGS.get(field, field)}: {rest}") from None
    if norm.kind != "lp" and fields["p"] != QKNormConfig.p:  # only lp reads p: another kind would drop it unsaid
        raise ValueError(f"--qk-norm-p: only read with --qk-norm lp, got --qk-norm {norm.kind}")
    return norm


def _convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from ..convert.qk_norm import DEFAULT_CALIBRATION_TOKENS, convert_checkpoint
    from ..utils.files import check_input_file, check_path
    from ..utils.threads import apply_threads

    check_path("--hf", args.hf, "checkpoint directory")
    check_path("--out", args.out, "checkpoint directory")
    norm = _qk_norm_from_flags(args)
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    apply_threads(args.threads, "convert")
    tokens = args.calibration_tokens
    if tokens is None:
        tokens = DEFAULT_CALIBRATION_TOKENS if norm is not None else 0
    text = None
    if args.calibration_text is not None:
        check_input_file("--calibration-text", args.calibration_text, "calibration text")  # a FIFO: read forever
        try:
            text = Path(args.calibration_text).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"calibration_text: cannot read {args.calibration_text} as UTF-8 text ({e})") from None
    try:
        report = convert_checkpoint(args.hf, args.out, qk_norm=norm, calibration_tokens=tokens,
                                    calibration_text=text, dtype=dtype, overwrite=args.overwrite,
                                    inputs=[("calibration_text", args.calibration_text)])
    except ValueError as e:  # the API's argument names (src, the loader's hf_dir), as this command's option
        name, _, rest = str(e).partition(": ")
        raise ValueError(f"{'--hf' if name in ('src', 'hf_dir') else name}: {rest}") from None
    for layer, blocks in (report.get("layers") or {}).items():
        print(f"layer {layer}: " + "; ".join(
            f"{block} logit RMS {r['rms_source']:.4g} (source), {r['rms_unit_weights']:.4g} (norm, unit weights) -> "
            f"{r['rms_calibrated']:.4g} (calibrated)" for block, r in blocks.items()))
    loss = report.get("loss")
    if loss:
        print(f"held-out loss: source {loss['source']:.4f}, norm at unit weights {loss['unit_weights']:.4f}, "
              f"calibrated {loss['calibrated']:.4f} ({loss['calibrated'] - loss['source']:+.4f})")
    print(f"wrote {args.out}")
    return 0


def _convert_gqa(args: argparse.Namespace) -> int:
    import torch

    from ..convert.gqa import convert_gqa_checkpoint
    from ..utils.files import check_path
    from ..utils.threads import apply_threads

    check_path("--hf", args.hf, "checkpoint directory")
    check_path("--out", args.out, "checkpoint directory")
    if args.calibration_tokens is not None and args.calibration_text is None:  # it would be ignored
        raise ValueError("--calibration-tokens: only read with --calibration-text; give the text too")
    apply_threads(args.threads, "convert-gqa")
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    try:
        report = convert_gqa_checkpoint(args.hf, args.out, kv_lora_rank=args.kv_lora_rank, rope_dim=args.rope_dim,
                                        rope_pairs=args.rope_pairs, keep_norm=not args.drop_norm,
                                        dtype=dtype,
                                        overwrite=args.overwrite, rope_key=args.rope_key, latent=args.latent,
                                        calibration_text=args.calibration_text,
                                        calibration_tokens=args.calibration_tokens)
    except ValueError as e:  # the source model is --hf here, its calibration ids --calibration-text (the other
        name, _, rest = str(e).partition(": ")  # names are options: main's flag_message)
        name = {"src": "hf", "model": "hf", "hf_dir": "hf", "calibration": "calibration_text"}.get(name, name)
        raise ValueError(f"{name}: {rest}") from None
    for line in report.lines():
        print(line)
    print(f"wrote {args.out}")
    return 0


def _experiment(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from ..experiments import EXPERIMENTS, Options, run_experiment
    from ..experiments.base import check_seeds, check_workers
    from ..experiments.results import read_results
    from ..utils.environment import check_launch
    from ..utils.files import check_input_file, check_path

    if args.list:
        given = [flag for flag, value in (("NAME", args.name), ("--seeds", args.seeds), ("--out", args.out),
                                          ("--sweep", args.sweep), ("--quick", args.quick or None),
                                          ("--overwrite", args.overwrite or None),
                                          ("--workers", args.workers),
                                          # a progress bar it never draws (the list was printed, the switch unread)
                                          ("--no-progress", args.no_progress or None)) if value is not None]
        if given:  # else silently ignored: `--list norm-mode` read as a request to run it
            raise ValueError(f"--list: names the experiments and exits, so it takes none of {', '.join(given)}; "
                             "run one with qkmla experiment NAME")
        width = max(len(name) for name in EXPERIMENTS)  # a name as long as the column ran into its description
        for e in EXPERIMENTS.values():
            print(f"{e.name:<{width}}  {e.description}")
        return 0
    if args.name is None:
        raise ValueError(f"NAME: missing; one of {', '.join(EXPERIMENTS)} (qkmla experiment --list)")
    if args.name not in EXPERIMENTS:
        raise ValueError(f"NAME: unknown {args.name!r}; allowed: {', '.join(EXPERIMENTS)}")
    check_seeds("--seeds", args.seeds)
    if args.seeds is not None and not EXPERIMENTS[args.name].reads_seeds:  # else silently ignored: its seeds ran
        takers = ", ".join(name for name, e in EXPERIMENTS.items() if e.reads_seeds)
        raise ValueError(f"--seeds: {args.name} trains the seeds its design fixes (docs/results.md), so it takes no "
                         f"--seeds; the experiments that do: {takers}")
    check_launch("experiment")  # the workers would wait for torchrun ranks that never come
    workers = 0 if args.workers is None else args.workers
    check_workers("--workers", workers)
    if args.sweep is not None and not EXPERIMENTS[args.name].reads_sweep:  # else silently ignored
        readers = ", ".join(name for name, e in EXPERIMENTS.items() if e.reads_sweep)
        raise ValueError(f"--sweep: {args.name} does not read lr-sweep results (it picks its own learning rates); "
                         f"the experiments that do: {readers}")
    if args.sweep is not None:
        check_input_file("--sweep", args.sweep, "results file")
    default = f"runs/experiments/{args.name}{'-quick' if args.quick else ''}"
    out = check_path("--out", default if args.out is None else args.out, "experiment directory")  # "": refused
    options = Options(out=out, quick=args.quick, seeds=args.seeds, workers=workers,
                      sweep=Path(args.sweep) if args.sweep else None, overwrite=args.overwrite)
    command = "qkmla experiment " + " ".join(map(shlex.quote, args.argv))
    report = run_experiment(EXPERIMENTS[args.name], options, progress=not args.no_progress, command=command)
    print(report.table)
    print(f"results: {out / 'results.jsonl'}; figures: {', '.join(str(f) for f in report.figures)}")
    # A grid whose report is drawn without some runs (an adaptive design's tolerates them) ended with exit 0,
    # its failures said only in "run NAME failed" lines above the tables (a run whose directory could not be
    # made has no row status but "missing"). Every run the plan lists has finished when the grid ends unstopped.
    failed = [r["run"] for r in read_results(out / "results.jsonl") if r.get("status") not in ("done", "non-finite")]
    if failed:
        shown = ", ".join(failed[:3]) + (", ..." if len(failed) > 3 else "")
        print(f"qkmla experiment: {len(failed)} run(s) did not finish ({shown}; each said why above, as 'run NAME "
              f"failed'); fix the cause and run the same command again, which trains only what is unfinished",
              file=sys.stderr)
        return 1
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from ..utils.environment import check_launch
    from ..utils.threads import apply_threads

    check_launch("demo")  # its runs would wait for torchrun ranks that never come
    apply_threads(args.threads, "demo")
    return run_demo(out=args.out, steps=args.steps, preset=args.preset, overwrite=args.overwrite)


def _option_dests(command: str) -> set:
    """The names of the options of ``command`` (an error naming one names the option)."""
    return option_dests(_command_parser(build_parser(), command))


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(prog="qkmla", description="QK-normalized Multi-head Latent Attention.")
    parser.add_argument("--version", action="version", version=f"qkmla {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    v = sub.add_parser("verify", help="check explicit == absorbed for every norm variant (paper Appendix E), "
                                      "and over quantized latent caches")
    v.add_argument("--json", action="store_true", help="print one JSON array, an object per row, instead of the tables")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--variant", action="append", help="run only this variant (repeatable)")
    v.add_argument("--kv-format", action="append", choices=["fp8", "int8", "int4"],
                   help="the quantized-cache rows of this format (repeatable): absorbed over the quantized cache == "
                        "explicit over its dequantized latent, and the quantization error")
    v.set_defaults(func=_verify)

    c = sub.add_parser("cache-size", help="KV-cache bytes per token and per request for MHA/GQA/MQA/MLA/QK-normed MLA")
    c.add_argument("--preset", choices=sorted(CACHE_PRESETS))
    c.add_argument("--tokens", type=int, default=32000, help="tokens per request (default 32,000)")
    c.add_argument("--json", action="store_true")
    for f in _SHAPE_FLAGS:
        c.add_argument(f"--{f.replace('_', '-')}", type=int, default=None)
    c.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None)
    c.add_argument("--scalar-dtype", choices=sorted(DTYPE_BYTES), default=None)
    c.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="how cached keys, values and latents are stored: bf16/fp16/fp32 dense (as --dtype); "
                        "fp8 = e4m3 with a float32 scale per 128 values (MLA at DeepSeek-V3 width: FlashMLA's "
                        "656 B); int8 = a float32 scale per vector; int4 = two per byte, a float32 scale per 32 "
                        "values; RoPE keys kept apart stay bf16, QK-norm scalars in --scalar-dtype")
    c.set_defaults(func=_cache_size)

    from ..train.cli import add_train_arguments

    t = sub.add_parser("train", help="train a small LM with any attention variant (see --attn)")
    add_train_arguments(t)
    t.set_defaults(func=_train)

    pl = sub.add_parser("plot", help="loss, max-logit and grad-norm curves of runs on one PNG")
    pl.add_argument("runs", nargs="+", help="run directories (with metrics.jsonl)")
    pl.add_argument("--out", default="runs/compare.png", help="the figure file: .png (or no suffix), .pdf, .svg, "
                    "... (default runs/compare.png)")
    pl.add_argument("--overwrite", action="store_true", help="replace the file OUT if it exists")
    pl.set_defaults(func=_plot)

    g = sub.add_parser("generate", help="sample from a trained run, or a transformers DeepSeek-V2/V3 checkpoint "
                                        "(--hf), through the latent cache")
    g.add_argument("run", nargs="?", default=None, help="run directory (with checkpoint.safetensors)")
    g.add_argument("--hf", default=None, metavar="DIR",
                   help="a transformers DeepSeek-V2/V3 checkpoint directory (config, weights, tokenizer) instead of "
                        "a run: decoded through qkmla.integrations.transformers.apply_latent_attention")
    g.add_argument("--dtype", default=None, help="with --hf: float32, bfloat16 or float64 (default: the dtype the "
                                                 "checkpoint's config.json records, float32 if none)")
    g.add_argument("--device", default=None, help="with --hf: cpu (default), or an accelerator this machine has: "
                                                  "cuda, cuda:N, ...")
    g.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable: one batch)")
    g.add_argument("--max-new-tokens", "--tokens", dest="max_new_tokens", type=int, default=200,
                   help="tokens to generate after each prompt (default 200)")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--kv-format", default="dense",
                   help=f"latent cache storage, MLA variants: one of {GENERATE_KV_FORMATS} (default dense)")
    g.add_argument("--policy", default=None,
                   help=f"eviction policy of the latent caches, MLA variants: one of {GENERATE_POLICIES}")
    g.add_argument("--kept-fraction", type=float, default=None,
                   help="with --policy: fraction of the tokens seen that each cache keeps, in (0, 1]")
    g.add_argument("--budget", type=int, default=None, help="with --policy: tokens each cache keeps")
    g.add_argument("--window", type=int, default=None,
                   help="with --policy h2o or snapkv: the newest tokens always kept (default 32), part of the budget")
    g.add_argument("--sinks", type=int, default=None,
                   help="with --policy: the first tokens always kept (default 4 for streaming-llm, else 0)")
    add_threads_argument(g)
    g.set_defaults(func=_generate)

    cv = sub.add_parser("convert", help="a transformers DeepSeek-V2/V3 checkpoint directory, given a QK norm "
                                        "calibrated on real text, as a new checkpoint directory")
    cv.add_argument("--hf", required=True, metavar="SRC", help="the checkpoint directory (config.json, safetensors, "
                                                               "tokenizer); never written")
    cv.add_argument("--out", required=True, metavar="DST", help="the new checkpoint directory")
    cv.add_argument("--qk-norm", choices=["rms", "l2", "lp"], default=None, help="the QK norm to add")
    cv.add_argument("--qk-norm-mode", choices=["blockwise", "unified", "content"], default="blockwise")
    cv.add_argument("--qk-norm-p", type=float, default=2.0, help="p of --qk-norm lp")
    cv.add_argument("--calibration-tokens", type=int, default=None,
                    help="tokens the norm is calibrated on (default 4096 with --qk-norm; 0: weights at ones)")
    cv.add_argument("--calibration-text", default=None, metavar="FILE",
                    help="UTF-8 text to calibrate on (default: the embedded Shakespeare)")
    cv.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    cv.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default=None,
                    help="default: the stored dtype")
    add_threads_argument(cv)
    cv.set_defaults(func=_convert)

    cg = sub.add_parser("convert-gqa", help="a transformers Qwen3 (or OLMoE) checkpoint directory converted to a "
                                            "DeepSeek-V3 (V2) architecture model with qkmla's QK norm (latent "
                                            "cache), as a new checkpoint directory")
    cg.add_argument("--hf", required=True, metavar="SRC",
                    help="the Qwen3 or OLMoE checkpoint directory; never written")
    cg.add_argument("--out", required=True, metavar="DST", help="the new checkpoint directory")
    cg.add_argument("--kv-lora-rank", type=int, default=None, metavar="N",
                    help="rank of the latent factorization of the keys and values (default: exact; the cached "
                         "latent is N + 1 wide)")
    cg.add_argument("--rope-dim", type=int, default=None, metavar="N",
                    help="RoPE dims kept rotated, even, up to head_dim (default: head_dim, every pair)")
    cg.add_argument("--rope-pairs", choices=["uniform", "high"], default=None,  # None: not given (gqa.resolve_rope)
                    help="with --rope-dim: which RoPE pairs it keeps: every (head_dim/N)-th (uniform, the "
                         "default), or the highest frequencies")
    cg.add_argument("--rope-key", choices=["mean", "principal"], default="mean",
                    help="how several KV heads' RoPE rows become the one shared RoPE key: their mean, or per kept "
                         "pair the mix that best fits every head's key on --calibration-text (TransMLA's RoRoPE)")
    cg.add_argument("--latent", choices=["weights", "activations"], default="weights",
                    help="the rank --kv-lora-rank factorization of the keys and values: best for any input (SVD of "
                         "the weights), or for the attention inputs of --calibration-text (activation-aware SVD)")
    cg.add_argument("--calibration-text", default=None, metavar="FILE",
                    help="text like the model's data, tokenized by the checkpoint's tokenizer: what --rope-key "
                         "principal and --latent activations fit to (and what the report measures the RoPE key's "
                         "share on)")
    cg.add_argument("--calibration-tokens", type=int, default=None, metavar="N",
                    help="with --calibration-text: its first N tokens, refused if it has fewer (default 16384, or all "
                         "of a shorter text)")
    cg.add_argument("--drop-norm", action="store_true",
                    help="drop the QK norm instead of carrying it (what TransMLA/CARE conversions do)")
    cg.add_argument("--dtype", choices=["float32", "bfloat16", "float64"], default=None,
                    help="default: the stored dtype")
    cg.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    add_threads_argument(cg)
    cg.set_defaults(func=_convert_gqa)

    e = sub.add_parser("experiment", help="run an experiment grid (see --list), resumable, with results and figures")
    e.add_argument("name", nargs="?", help="the experiment (qkmla experiment --list)")
    e.add_argument("--list", action="store_true", help="name the experiments and exit")
    e.add_argument("--quick", action="store_true", help="the test-sized grid (seconds)")
    e.add_argument("--seeds", type=int, default=None, help="seeds per variant (default: the experiment's)")
    e.add_argument("--out", default=None, help="directory (default runs/experiments/NAME)")
    # default None, not 0: `--list --workers 0` names a flag --list ignores, and is refused like any other
    e.add_argument("--workers", type=int, default=None, help="processes, one thread each (default 0: one per core)")
    e.add_argument("--sweep", default=None, help="lr-sweep results.jsonl giving each variant's best lr, for the "
                                                 "experiments that train at it (length, lp-sweep, norm-mode, qk-clip; "
                                                 "refused for the others) (default: OUT/../lr-sweep/results.jsonl)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace another experiment's results in OUT, or finished runs there trained with other "
                        "settings (without it, refused)")
    e.add_argument("--no-progress", action="store_true")
    e.set_defaults(func=_experiment)

    d = sub.add_parser("demo", help="the main job: QK-normed vs plain MLA at a moderate and a high lr "
                                    "(~3 min on 2 cores)")
    d.add_argument("--out", default="runs/demo")
    d.add_argument("--steps", type=int, default=None, help="steps per run (default 750: fixed, so results reproduce)")
    d.add_argument("--preset", default="cpu")
    d.add_argument("--overwrite", action="store_true", help="replace a demo already in OUT")
    add_threads_argument(d)
    d.set_defaults(func=_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command (:func:`~qkmla.utils.command.run_command` says how each ending reads: a
    refusal naming the option, exit 2; the machine's error naming the path, 1; a closed stdout,
    141; a signal, one line and 128 + its number; anything else is a bug, with its traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse blames the top parser for a command's unknown flags: name the command, as its --help does
        blamed = parser
        if unknown[0] in argv[argv.index(args.command) + 1:]:
            blamed = _command_parser(parser, args.command)
        blamed.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.argv = argv[1:]
    if getattr(args, "func", None) is _generate and not args.prompt:
        args.prompt = ["\n"]
    return run_command(args.command, lambda: args.func(args), lambda: _option_dests(args.command))


if __name__ == "__main__":
    sys.exit(main())
