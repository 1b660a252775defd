"""Sizes that drive an allocation, checked against the memory this machine has before any work.

An option such as ``--tokens 100000000`` or ``--batch-size 10000000`` is accepted by every
range check and then fails minutes later with an out-of-memory error (or a machine that
swaps until it is killed). :func:`check_fits` refuses it up front, naming the option, when
a lower bound of what it needs exceeds the memory available now: it never refuses a size
that could run, and the bound is stated in the message.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def address_space_left() -> Optional[int]:
    """Bytes of address space this process may still map under its RLIMIT_AS (``ulimit -v``,
    ``prlimit --as``), or None without such a limit (or where it cannot be read). Under that limit
    every allocation past it fails whatever the machine has free, so a size check against
    MemAvailable alone let ``train --preset paper-400m`` start under ``ulimit -v 4000000`` and fail
    in torch's allocator a minute later."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return max(soft - int(line.split()[1]) * 1024, 0)
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_bytes() -> Optional[int]:
    """Memory this process can still allocate, in bytes: Linux's MemAvailable, lowered to what
    the cgroup's limit leaves (a container's) and to the address space its RLIMIT_AS leaves, or
    None where none of them can be read."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    limit, used = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and used is not None:
        avail = limit - used if avail is None else min(avail, limit - used)
    left = address_space_left()
    if left is not None:
        avail = left if avail is None else min(avail, left)
    return avail


def gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**27 else f"{n / 2**20:.3g} MiB"


def check_fits(name: str, needed: int, what: str) -> None:
    """ValueError naming ``name`` if ``needed`` bytes (a lower bound of what ``what`` takes)
    exceed the memory available now; nothing where the available memory is unknown."""
    avail = available_bytes()
    if avail is not None and needed > avail:
        raise ValueError(f"{name}: {what} need at least {gib(needed)}, more than the {gib(avail)} of memory "
                         f"available; use a smaller value")


def check_weights(name: str, shapes, what: str) -> None:
    """:func:`check_allocation` for new parameters of ``shapes`` (an iterable of tuples) in torch's
    default dtype on its default device, before a module makes them: ``MLA(MLAConfig(hidden_size=2**40))``
    reached torch's allocator ("you tried to allocate 140737488355328 bytes", or "Storage size calculation
    overflowed"). On the meta device (a model built to load its weights into) only sizes past int64,
    which torch cannot make there either, are refused; under ``set_default_device("cuda")``, the
    accelerator's free memory is the bound."""
    import math

    import torch

    shapes = [tuple(shape) for shape in shapes]
    if any(math.prod(shape) * torch.get_default_dtype().itemsize >= 2**63 for shape in shapes):
        raise ValueError(f"{name}: {what} hold a tensor of 2**63 bytes or more, which torch cannot make on any "
                         "device; use smaller sizes")
    # torch.get_default_device() ignores `with torch.device("meta")` before torch 2.8; a new tensor does not
    check_allocation(name, torch.get_default_dtype().itemsize * sum(math.prod(s) for s in shapes), what,
                     torch.empty(0).device)


def check_allocation(name: str, needed: int, what: str, device=None) -> None:
    """:func:`check_fits` for a tensor of ``needed`` bytes on ``device`` (None: the CPU): on an
    accelerator, against the memory free there."""
    kind = getattr(device, "type", None) or (str(device).split(":")[0] if device is not None else "cpu")
    if kind == "cpu":
        check_fits(name, needed, what)
        return
    try:
        import torch

        # the driver's free memory, and what torch's caching allocator holds free in its pool (after a large
        # prefill the driver's figure alone is near 0, and a tensor that fits in the pool was refused)
        free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
            - torch.cuda.memory_allocated(device) if kind == "cuda" else None
    except (RuntimeError, AssertionError, ValueError):
        free = None
    if free is not None and needed > free:
        raise ValueError(f"{name}: {what} need at least {gib(needed)}, more than the {gib(free)} free on {device}; "
                         "use a smaller value")
