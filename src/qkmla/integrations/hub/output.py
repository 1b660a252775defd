"""Whether a checkpoint directory may be written: what every writer of one (``qkmla convert`` and
``convert-gqa``, torchtitan's ``export_hf``) checks of its output before any work, so that all refuse
the same things: a file, the source or a directory around it, a directory holding another input, a
non-empty directory without the overwrite flag, and, with it, anything but a checkpoint holding only
what the write makes (the directory is replaced whole).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterable, Optional

from ...utils.checked import check_bool
from .checkpoint import CONFIG


def check_checkpoint_out(out: Path, given, src: Optional[Path], overwrite: bool, inputs: Iterable = (),
                         name: str = "out", flag: str = "--overwrite", writer: str = "conversion",
                         copies_source: bool = True) -> None:
    """Whether the checkpoint directory ``out`` (``given`` as the caller named it) may be written: a
    ValueError naming ``name`` for a file there, for ``src`` (the directory read) or a directory holding it
    or inside it, for a directory holding one of ``inputs`` ((option, path) of the other files read), and,
    for a non-empty directory, without ``flag`` or unless it is a checkpoint holding only what this write
    makes. Shared by ``qkmla convert`` / ``convert-gqa`` and ``torchtitan.export_hf``, so that every
    writer of a checkpoint directory refuses the same things (export_hf once replaced a user's file, a
    training run or a directory of notes whole, given overwrite=True). ``copies_source``: the writer
    copies ``src``'s top-level files (a conversion does; an export from a DCP directory does not, so a
    file named as one of those is not its to replace)."""
    check_bool("overwrite", overwrite)  # its callers check it first, before any work; kept for any other
    if out.exists() and not out.is_dir():
        raise ValueError(f"{name}: {given} is a file; it names the directory the {writer} is written to")
    resolved_out = out.resolve()
    verb = {"conversion": "converted", "export": "exported"}.get(writer, "read")
    if src is not None:
        resolved_src = src.resolve()
        if resolved_out == resolved_src or resolved_src in resolved_out.parents:
            raise ValueError(f"{name}: {given} is the checkpoint being {verb} (or inside it); write elsewhere")
        if resolved_out in resolved_src.parents:
            raise ValueError(f"{name}: {given} holds the checkpoint being {verb}; replacing it would destroy the "
                             "source")
        _check_links_into(resolved_out, given, src, name, verb)
    for option, path in inputs:  # --overwrite replaced the directory with the file read inside it (or itself)
        if path is None:
            continue
        resolved = Path(path).resolve()
        if resolved_out == resolved or resolved_out in resolved.parents:
            raise ValueError(f"{name}: {given} holds {path}, the --{option.replace('_', '-')} this {writer} reads; "
                             "replacing it would destroy that: write elsewhere, or move it out first")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ValueError(f"{name}: {given} already exists and is not empty; pass {flag} to replace it, or write "
                             f"elsewhere")
        if not _holds_checkpoint(out):  # a qkmla training run has a config.json too, without a model_type
            raise ValueError(f"{name}: {given} is not empty and holds no transformers {CONFIG} (a JSON object with a "
                             f"model_type), so it is not a checkpoint directory {flag} may replace; write "
                             f"elsewhere")
        theirs = [p.name for p in sorted(out.iterdir()) if not _conversion_writes(p, src if copies_source else None)]
        if theirs:  # the directory is replaced whole: a file of the user's there would be lost with it
            raise ValueError(f"{name}: {given} holds {', '.join(theirs[:3])}{' ...' if len(theirs) > 3 else ''}, "
                             f"which this {writer} does not write; {flag} replaces the directory whole, so move "
                             f"{'it' if len(theirs) == 1 else 'them'} out first, or write elsewhere")


def _check_links_into(resolved_out: Path, given, src: Path, name: str, verb: str) -> None:
    """A ValueError naming ``name`` when a file of ``src`` is a link into ``out`` (a checkpoint directory of links
    to another's files): ``out`` is then where the source's bytes are, and replacing it (--overwrite) replaced the
    source's files with the new checkpoint's, the links left pointing at them (or at nothing)."""
    for entry in sorted(src.iterdir()):
        if not entry.is_symlink():
            continue
        try:
            target = entry.resolve()
        except (OSError, RuntimeError):  # a loop of links (RuntimeError before Python 3.13) points at no file
            continue
        if target == resolved_out or resolved_out in target.parents:
            raise ValueError(f"{name}: {given} holds {target}, which {entry} of the checkpoint being {verb} links to; "
                             f"replacing it would destroy the source: write elsewhere")


# What a conversion writes besides the files it copies from its source (copy_other_files): the
# config, the weights and their index, the model code an auto_map names, the tokenizer's files.
WRITTEN = re.compile(r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|added_tokens|vocab)"
                     r"\.json|model(-\d+-of-\d+)?\.safetensors|model\.safetensors\.index\.json|merges\.txt|"
                     r"vocab\.txt|(tokenizer|spiece|sentencepiece\.bpe)\.model|chat_template\.(jinja|json)|"
                     r"(modeling|configuration)_\w+\.py")


def _conversion_writes(path: Path, src: Optional[Path]) -> bool:
    """Whether a conversion of ``src`` writes ``path`` (an entry of its output directory): one of
    :data:`WRITTEN`, or a top-level file of the source that it copies. Anything else there, a
    user's notes or a folder, is not the conversion's to replace."""
    if path.is_dir() and not path.is_symlink():
        return False
    return WRITTEN.fullmatch(path.name) is not None or (src is not None and (src / path.name).is_file())


def _holds_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a transformers checkpoint's config.json (what a conversion writes)."""
    try:
        config = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("model_type"), str)
