"""qkmla's CPU kernels, compiled on first use into one PyTorch extension (``torch.ops.qkmla_cpu``).

Two sources, each registering its ops in the ``qkmla_cpu`` namespace:

* ``mla_decode/cpu_kernel.cpp``: the decode op's ``"cpu"`` backend (``mla_decode/cpu_kernel.py``);
* ``small_linear.cpp``: x W^T for a few rows of x against a prepacked weight, and a QK norm's
  key statistic of each group of rows of an unpacked one (``small_linear.py``).

Both run on AVX-512 BF16 dot products (``vdpbf16ps``). They are compiled together by PyTorch's
C++ extension loader, which needs a C++ compiler and ninja on the machine (9 s on 2 idle cores
here, longer under load), then cached under ``TORCH_EXTENSIONS_DIR`` in a directory named for
the sources, the flags and the torch version, so environments with other torch builds do not
rebuild each other's. :func:`build` says why the kernels cannot run (no AVX-512 BF16, no
compiler, a failed build, reported once as a warning); their callers then keep their torch
paths. ``QKMLA_CPU_KERNEL=0`` turns the kernels off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

HERE = Path(__file__).parent
SOURCES = (HERE / "mla_decode" / "cpu_kernel.cpp", HERE / "small_linear" / "small_linear.cpp")
HEADERS = (HERE / "bf16.h",)  # included by the sources; in the build's name, so a change rebuilds
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]
STALE_LOCK_S = 600  # a build lock older than this was left by a build that died (no build takes so long)


def cpu_has_avx512_bf16() -> bool:
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(check()) if check is not None else False


def extension_name() -> str:
    """One build per sources (headers included), flags and torch build: a name the loader keys its directory by."""
    digest = hashlib.sha1(b"".join(f.read_bytes() for f in SOURCES + HEADERS) + " ".join(CFLAGS).encode()
                          + torch.__version__.encode())
    return f"qkmla_cpu_{digest.hexdigest()[:12]}"


def clear_stale_lock(name: str) -> None:
    """The loader waits without a timeout on a lock file that a killed build leaves behind."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:  # a private helper; without it a stale lock is the loader's to handle
        return
    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass


@functools.lru_cache(maxsize=None)
def build() -> Optional[str]:
    """Compile and load the kernels once per process; the reason they cannot be, or None."""
    from ..utils.environment import switch

    if not switch("QKMLA_CPU_KERNEL"):  # junk ("off") is refused naming the variable, not read as on
        return "the CPU kernel is turned off (QKMLA_CPU_KERNEL=0)"
    if sys.platform != "linux":
        return f"the CPU kernel is built on Linux only, this is {sys.platform}"
    if not cpu_has_avx512_bf16():
        return "the CPU kernel needs AVX-512 BF16 (vdpbf16ps), which this CPU lacks"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "the CPU kernel is compiled on first use and needs a C++ compiler (c++, or $CXX)"
    try:
        from torch.utils.cpp_extension import load, verify_ninja_availability
        verify_ninja_availability()
    except Exception:  # RuntimeError: ninja is not installed
        return "the CPU kernel is compiled on first use and needs ninja (pip install ninja)"
    try:
        name = extension_name()
        clear_stale_lock(name)
        load(name=name, sources=[str(source) for source in SOURCES], is_python_module=False, verbose=False,
             extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"])
    except Exception as exc:  # a failed build leaves the torch paths; the reason is reported
        last = (str(exc).strip().splitlines() or [""])[-1][:300]
        reason = f"the CPU kernel did not build: {type(exc).__name__}: {last}"
        warnings.warn(f"qkmla: {reason}; using the torch paths instead", RuntimeWarning, stacklevel=2)
        return reason
    return None
