"""What the benchmark scripts share: a positive-int argument type, the refusal of an existing
--out (every script that writes one), and for the transformers recipes (hf_qknorm_recipe.py, gqa_convert_recipe.py) and
vllm_serving.py the refusal to reuse work directories, the results record written after every
stage, and the embedded Shakespeare's plays as byte tokens."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path


def positive(text: str) -> int:
    """An argparse type: an int >= 1, refused naming the value otherwise."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def check_out(parser, out, overwrite: bool) -> None:
    """Refuse (``parser.error``) an ``--out`` that is a directory, or exists without ``overwrite``
    (``qkmla.utils.files.check_output``), before any work; None: nothing is written."""
    from qkmla.utils.files import check_output

    try:
        check_output("--out", [out] if out is not None else [], [], overwrite)
    except ValueError as e:
        parser.error(str(e))


def claim_work_dirs(parser, dirs, overwrite: bool) -> None:
    """Refuse (``parser.error``) work directories that exist unless ``overwrite``; then empty them."""
    taken = [str(d) for d in dirs if d.exists()]
    if taken and not overwrite:
        parser.error(f"--work: {', '.join(taken)} exist; pass --overwrite to replace them, or give another --work")
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def start_record(script: str, argv, here: Path, args, transformers_version: str):
    """(result, write): the results record of a run (command, commit, machine, settings) and the
    function that writes it to ``args.out`` atomically, called after every stage so that an
    interrupted run keeps what it measured."""
    from qkmla.utils.files import write_text
    from qkmla.utils.machine import machine, recorded_command, source_commit

    t_start = time.perf_counter()
    result = {"command": recorded_command(script, argv), "commit": source_commit(here), "machine": machine(),
              "transformers": transformers_version, "status": "running",
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}

    def write() -> None:
        result["wall_s"] = round(time.perf_counter() - t_start, 1)
        result["load_average_1min"] = round(os.getloadavg()[0], 2)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_text(args.out, json.dumps(result, indent=1) + "\n")

    return result, write


def byte_plays(tokenizer):
    """(training-play ids, validation-play ids): the embedded Shakespeare split by play
    (``qkmla.train.data.split_by_play``), as byte tokens of ``tokenizer`` without special tokens."""
    import torch

    from qkmla.train.data import load_text, split_by_play

    splits = split_by_play(load_text("shakespeare"))
    return tuple(torch.tensor(tokenizer(splits[s], add_special_tokens=False)["input_ids"]) for s in ("train", "val"))
