"""How every qkmla command writes a file: to a temporary name in the same directory, then renamed.

A crash, a kill or a full disk in the middle of a write leaves the file that was there (or
none), never half of a new one: ``os.replace`` within one directory is atomic. The
temporary name is ``NAME.tmpPID``; a failed write removes it. Errors are ``OSError``s that
name the path (safetensors' own error for a failed write is turned into one), which the
command line reports in one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Iterable, Optional, Union

PathLike = Union[str, Path]


def temporary_name(path: PathLike) -> Path:
    path = Path(path)
    return path.with_name(f"{path.name}.tmp{os.getpid()}")


def write_atomically(path: PathLike, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` writes the file at a temporary path beside ``path``, which then replaces
    ``path`` in one rename. On any failure the temporary file is removed and ``path`` is
    untouched."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(e, OSError) and e.filename in (str(tmp), tmp):  # the user named path, not tmp
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    return path


def write_text(path: PathLike, text: str) -> Path:
    return write_atomically(path, lambda tmp: tmp.write_text(text))


def save_safetensors(tensors: dict, path: PathLike, metadata: Optional[dict] = None) -> Path:
    """``safetensors.torch.save_file``, atomically, with an I/O failure (a full disk, a file size
    limit, no permission) raised as the ``OSError`` it is, naming ``path``."""
    from safetensors.torch import save_file

    def write(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except Exception as e:
            if type(e).__name__ != "SafetensorError":
                raise
            code = re.search(r"os error (\d+)", str(e))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None

    return write_atomically(path, write)


def same_file(a: PathLike, b: PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output(name: str, outputs: Iterable[PathLike], inputs: Iterable[PathLike], overwrite: bool,
                 what: str = "output") -> None:
    """Before any work: ValueError naming option ``name`` if an output file is one of the inputs
    (whatever ``overwrite`` says), is a directory, or already exists without ``overwrite``."""
    inputs = [Path(p) for p in inputs]
    existing = []
    for out in map(Path, outputs):
        clash = next((p for p in inputs if out == p or same_file(out, p)), None)
        if clash is not None:
            raise ValueError(f"{name}: {out} is an input of this command ({clash}); writing it would destroy "
                             f"what is being read, so write elsewhere")
        if out.is_dir():
            raise ValueError(f"{name}: cannot write the {what} file {out}, which is a directory; write elsewhere")
        if out.exists():
            existing.append(str(out))
    if existing and not overwrite:
        raise ValueError(f"{name}: {', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; pass "
                         f"--overwrite to replace {'it' if len(existing) == 1 else 'them'}, or write elsewhere")
