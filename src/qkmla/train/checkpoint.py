"""Checkpoints in safetensors: weights, optimizer state, RNG state and the run's config.

``DIR/checkpoint.safetensors`` holds every tensor (``model.*``, ``optim.*``, ``rng.*``) and,
in its string metadata, the JSON of the configs, the step, the optimizer's non-tensor
state and a CRC-32 of every tensor's bytes. It is written to a temporary file and renamed,
so a crash mid-write keeps the previous checkpoint. Reading checks the file's structure and
every checksum, so a truncated file or flipped tensor bytes give one error naming the file.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load

from ..utils.files import not_a_regular_file, save_safetensors

FILENAME = "checkpoint.safetensors"


def _flatten(prefix: str, obj: Any, tensors: dict, skeleton: Any = None):
    """Split a nested state (dicts, lists, tensors, scalars) into tensors and a JSON skeleton."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach().cpu().contiguous()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {"__dict__": [[str(k), type(k).__name__, _flatten(f"{prefix}.{k}", v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_flatten(f"{prefix}.{i}", v, tensors) for i, v in enumerate(obj)],
                "tuple": isinstance(obj, tuple)}
    return {"__value__": obj}


def _unflatten(node: Any, tensors: dict):
    if "__tensor__" in node:
        return tensors[node["__tensor__"]]
    if "__dict__" in node:
        return {(int(k) if kind == "int" else k): _unflatten(v, tensors) for k, kind, v in node["__dict__"]}
    if "__list__" in node:
        items = [_unflatten(v, tensors) for v in node["__list__"]]
        return tuple(items) if node.get("tuple") else items
    return node["__value__"]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted (truncated, corrupt, or not ours)."""


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (any dtype)."""
    return zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _metadata_checksum(metadata: dict) -> int:
    text = json.dumps({k: v for k, v in metadata.items() if k != "crc32_metadata"}, sort_keys=True)
    return zlib.crc32(text.encode())


def save_checkpoint(out_dir: Path, model_state: dict, optim_state: dict, step: int, config: dict,
                    generator: torch.Generator) -> Path:
    """Write ``out_dir/checkpoint.safetensors`` atomically, from full (unsharded) state dicts."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}
    aliases = {}
    for name, t in model_state.items():
        if t.data_ptr() in seen:  # tied weights are stored once
            aliases[name] = seen[t.data_ptr()]
            continue
        seen[t.data_ptr()] = f"model.{name}"
        tensors[f"model.{name}"] = t.detach().cpu().contiguous()
    optim_skeleton = _flatten("optim", optim_state, tensors)
    tensors["rng.generator"] = generator.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    metadata = {"config": json.dumps(config), "step": str(step), "optim": json.dumps(optim_skeleton),
                "aliases": json.dumps(aliases), "crc32": json.dumps({k: checksum(t) for k, t in tensors.items()})}
    metadata["crc32_metadata"] = str(_metadata_checksum(metadata))
    return save_safetensors(tensors, out_dir / FILENAME, metadata)  # a temporary name, then renamed


def _header(path: Path) -> dict:
    """The JSON header of a safetensors file, read by Python (any path the OS takes, UTF-8 or not:
    safetensors' own reader refuses the rest)."""
    kind = not_a_regular_file(Path(path))
    if kind is not None:  # opening a FIFO waits for a writer: `train --resume` over one hung for good
        raise ValueError(f"{kind}, not a regular file")
    with open(path, "rb") as f:
        size = f.read(8)
        if len(size) < 8:
            raise ValueError("shorter than a safetensors header")
        n = int.from_bytes(size, "little")
        if n > 100_000_000:
            raise ValueError(f"a header of {n} bytes")
        text = f.read(n)
    if len(text) < n:
        raise ValueError("its header is cut short")
    header = json.loads(text)
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    return header


def read_metadata(path: Path) -> dict:
    try:
        meta = _header(Path(path)).get("__metadata__") or {}
    except OSError:
        raise
    except Exception as e:  # not a safetensors file, or one cut short
        raise CheckpointError(f"checkpoint: {path} is truncated or corrupt and cannot be read ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"checkpoint: {path} is corrupt: its metadata is not a JSON object")
    missing = [k for k in ("config", "step", "optim", "aliases") if k not in meta]
    if missing:
        raise CheckpointError(f"checkpoint: {path} is not a qkmla training checkpoint (metadata lacks {missing})")
    if "crc32_metadata" in meta and meta["crc32_metadata"] != str(_metadata_checksum(meta)):
        raise CheckpointError(f"checkpoint: {path} is corrupt: its metadata (config, step, optimizer layout) "
                              "fails its checksum")
    return meta


def _transformers_model_type(directory: Path):
    """The model_type of ``directory/config.json`` when it is a transformers config (a JSON object naming one,
    as a training run's config.json never does), else None; a file that cannot be read is not one."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type if isinstance(model_type, str) else None


def read_checkpoint(path: Path) -> tuple[dict, dict, dict]:
    """(model state dict, all tensors, metadata) of a checkpoint file or run directory."""
    path = Path(path)
    given_dir = path.is_dir()
    if given_dir:
        path = path / FILENAME
    if not path.is_file():
        kind = not_a_regular_file(path)
        if kind is not None:  # a FIFO there (or a directory) was said as "no checkpoint at" it, as if missing
            raise ValueError(f"run_dir: {path} is {kind}, not a regular file, so there is no checkpoint to read; "
                             f"give a run directory whose {FILENAME} qkmla wrote, or that file")
        # `qkmla generate HF_DIR` without --hf (probe14 G19): said as what the directory is. Only for a directory
        # given: a mistyped file's path in one is "no checkpoint at" that file.
        model_type = _transformers_model_type(path.parent) if given_dir else None
        if model_type is not None:
            raise ValueError(f"run_dir: {path.parent} holds a transformers checkpoint (a {model_type!r} config.json), "
                             f"not a qkmla training run (no {FILENAME}); for a model type qkmla serves (--hf refuses "
                             f"the others, naming those it serves), sample from it with qkmla generate --hf DIR, or "
                             f"load it with qkmla.integrations.transformers.from_pretrained(DIR)")
        # A demo's or an experiment's directory (probe15 G5): "no checkpoint at" it said nothing of the runs
        # inside, which are the runs to sample from.
        runs = sorted(p.parent for pattern in (f"*/{FILENAME}", f"runs/*/{FILENAME}")
                      for p in path.parent.glob(pattern)) if given_dir else []
        if runs:
            from ..utils.files import directory_kind

            kind = directory_kind(path.parent)
            what = f"{kind[1]}, with {len(runs)} run(s) in it" if kind is not None else f"{len(runs)} run(s)"
            raise ValueError(f"run_dir: no checkpoint at {path}: {path.parent} holds {what}; give a run's own "
                             f"directory, e.g. {runs[0]}")
        raise ValueError(f"run_dir: no checkpoint at {path}")
    meta = read_metadata(path)
    try:  # the bytes, not the path: safetensors cannot open a path that is not UTF-8
        tensors = load(path.read_bytes())
    except OSError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint: {path} is truncated or corrupt and cannot be read ({e})") from None
    sums = json.loads(meta.get("crc32", "{}"))  # absent in checkpoints written before checksums
    bad = [k for k, crc in sums.items() if k not in tensors or checksum(tensors[k]) != crc]
    if bad:
        raise CheckpointError(f"checkpoint: {path} is corrupt: {len(bad)} tensor(s) fail their checksum "
                              f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
    # In a fixed order: safetensors gives the tensors back in another order in every process, and
    # FSDP's full-state-dict load scatters them one by one in the order given, so the ranks of a
    # resume under FSDP paired different tensors in one collective and failed.
    state = {k[len("model."):]: tensors[k] for k in sorted(tensors) if k.startswith("model.")}
    for name, target in sorted(json.loads(meta["aliases"]).items()):
        state[name] = tensors[target]
    return state, tensors, meta


def load_checkpoint(path: Path, generator: torch.Generator) -> tuple[dict, dict, int]:
    """Restore the RNG state; returns (model state dict, optimizer state dict, step)."""
    state, tensors, meta = read_checkpoint(path)
    generator.set_state(tensors["rng.generator"])
    torch.set_rng_state(tensors["rng.torch"])
    return state, _unflatten(json.loads(meta["optim"]), tensors), int(meta["step"])
