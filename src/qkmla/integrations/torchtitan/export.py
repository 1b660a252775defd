"""A torchtitan run's checkpoint (DCP) as a Hugging Face checkpoint, from the run's own command line.

    python -m qkmla.integrations.torchtitan.export RUN/checkpoint/step-1000 OUT_DIR \\
        -- --module qkmla.integrations.torchtitan --config qkmla_cpu_qk_norm

Everything after ``--`` is the training command line's torchtitan arguments (what followed
``-m torchtitan.train``: ``--module``, ``--config``, ``--override.imports`` and any model settings):
the model is rebuilt from them as torchtitan's Trainer builds it (its configs and overrides, on one
process, no parallelism), its weights are read from the checkpoint (model states only; DCP
reshards whatever parallelism wrote them) and it is written by :func:`checkpoint.export_hf`, which
``qkmla.integrations.transformers.from_pretrained`` loads and the vLLM plugin serves.

Refused before anything is read or written, naming the argument: a checkpoint directory without
DCP metadata, an existing ``OUT_DIR`` (without ``--overwrite``), a command line torchtitan's own
parser refuses; then a checkpoint that lacks a tensor of the model, or holds one of another shape
or more of them (the command line does not describe the run that wrote it, e.g. a QK-normed run
exported as a plain one).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from .versions import check_torchtitan

try:
    check_torchtitan()
except ImportError as e:
    if __name__ == "__main__":  # the command without torchtitan (or another release): its one line, not a traceback
        sys.exit(f"error: {e}")
    raise

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.config.override import apply_overrides  # noqa: E402

from .checkpoint import check_export_out, export_hf  # noqa: E402
from .flavors import materialize  # noqa: E402

DTYPES = {"keep": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def config_from_args(train_args: Sequence[str]):
    """The ``Trainer.Config`` of a torchtitan command line, its overrides applied."""
    config = ConfigManager().parse_args(list(train_args))
    if config.override.imports:
        apply_overrides(config.override, config)
    return config


def model_from_args(train_args: Sequence[str]):
    """The model a torchtitan command line trains, built on the CPU (weights initialized, to be
    replaced by a checkpoint's)."""
    return materialize(config_from_args(train_args).model_spec.model)


def load_dcp(checkpoint_dir, model) -> None:
    """Read a model's states from a torchtitan DCP checkpoint directory, in place (no process group)."""
    reader = dcp.FileSystemReader(str(checkpoint_dir))
    try:
        saved = reader.read_metadata().state_dict_metadata
    except Exception as e:  # a truncated or foreign .metadata: torch's unpickler says only 'invalid load key'
        raise ValueError(f"checkpoint: {checkpoint_dir}/.metadata is not a readable DCP checkpoint's metadata "
                         f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    state = model.state_dict()
    missing = [k for k in state if k not in saved]
    if missing:
        raise ValueError(f"checkpoint: {checkpoint_dir} has no {missing[:3]}{' ...' if len(missing) > 3 else ''} "
                         f"({len(missing)} of the model's {len(state)} states): the training arguments after '--' "
                         "must be the run's")
    roots = {k.split(".")[0] for k in state}  # the model's top-level names; optimizer/train_state/... are not
    extra = [k for k in saved if k.split(".")[0] in roots and k not in state]
    if extra:
        raise ValueError(f"checkpoint: {checkpoint_dir} holds model states the training arguments do not build: "
                         f"{extra[:3]}{' ...' if len(extra) > 3 else ''} ({len(extra)}): the arguments after '--' "
                         "must be the run's (its --config and --override.imports)")
    for k in [k for k in state if k.endswith("_extra_state") and hasattr(saved[k], "size")]:
        # a QK norm's record of its variant (bytes): read as saved, so that loading names both variants
        state[k] = torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype)
    wrong = [f"{k} {tuple(saved[k].size)} (model: {tuple(t.shape)})" for k, t in state.items()
             if isinstance(t, torch.Tensor) and hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(t.shape)]
    if wrong:
        raise ValueError(f"checkpoint: shapes differ from the model the training arguments build: {wrong[:3]}")
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
    except Exception as e:  # a truncated or missing .distcp shard: DCP's CheckpointException wraps the I/O error
        raise ValueError(f"checkpoint: {checkpoint_dir}: its tensors cannot be read ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
    try:
        model.load_state_dict(state)
    except ValueError as e:  # a QK norm variant other than the checkpoint's (RecordsVariant names both)
        raise ValueError(f"checkpoint: {e}; the arguments after '--' must be the run's (its --override.imports)") \
            from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, train_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m qkmla.integrations.torchtitan.export",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="after '--': the training run's torchtitan arguments")
    parser.add_argument("checkpoint", help="a DCP step directory, e.g. RUN/checkpoint/step-1000")
    parser.add_argument("out_dir", help="the Hugging Face checkpoint directory to write")
    parser.add_argument("--dtype", choices=list(DTYPES), default="keep", help="stored dtype (default: as trained)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    args = parser.parse_args(ours)
    if not train_args:
        parser.error("the training arguments: expected '-- --module ... --config ...' (the run's command line)")
    checkpoint, out = Path(args.checkpoint), Path(args.out_dir)
    if not (checkpoint / ".metadata").is_file():
        parser.error(f"checkpoint: {checkpoint} is not a DCP checkpoint directory (no .metadata)")
    try:
        # Before the model is built: the out_dir export_hf would refuse after the work (the step directory
        # itself or its run directory with --overwrite: the training checkpoint replaced by the export)
        check_export_out(out, args.overwrite, source=checkpoint)
        model = model_from_args(train_args)
        load_dcp(checkpoint, model)
        export_hf(model, out, overwrite=args.overwrite, dtype=DTYPES[args.dtype], source=checkpoint)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk or a file size limit while writing: one line naming the path (export_hf's)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
