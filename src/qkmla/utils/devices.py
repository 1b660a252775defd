"""The device a user names (``--device``, a cache's ``device=``), checked against this machine
before anything is allocated on it: one ValueError naming the argument and what this machine
has, where torch would say ``Torch not compiled with CUDA enabled`` (an AssertionError) or list
every device type it knows."""

from __future__ import annotations

import torch


def check_device(name: str, device, meta: bool = False) -> torch.device:
    """``device`` (a str, a ``torch.device`` or None for the CPU) as a torch.device: the CPU, or an
    accelerator this machine has (``cuda``, ``cuda:1``, ...), or with ``meta`` torch's meta device
    (shapes without storage, as a model built under ``init_empty_weights`` has). ValueError naming
    ``name`` otherwise."""
    if device is None:
        return torch.device("cpu")
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6; before it, CUDA is the one looked for
    if accelerator is not None:
        found = accelerator.current_accelerator()
        kind, count = (found.type, accelerator.device_count()) if found is not None else (None, 0)
    else:
        kind, count = ("cuda", torch.cuda.device_count()) if torch.cuda.is_available() else (None, 0)
    allowed = ("cpu",) + ((kind, f"{kind}:N with N < {count}") if kind is not None else ())
    try:
        checked = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        checked = None
    if checked is None or checked.type not in ("cpu", kind) + (("meta",) if meta else ()) or \
            (checked.type == kind and checked.index is not None and checked.index >= count):
        where = "" if kind is not None else " (torch sees no accelerator here)"
        raise ValueError(f"{name}: expected one of {allowed} on this machine{where}, got {str(device)!r}")
    return checked
