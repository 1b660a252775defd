"""The decode op's backends, by name, and the one decision of which runs.

:data:`DECODE_BACKENDS` is the registry every setting that names a backend is checked against
(``MLAConfig.decode_backend``, ``apply_latent_attention``, the vLLM plugin): :func:`check_backend`.
:func:`resolve_backend` turns a name into the backend that runs for a call's inputs, "auto"
included, once; a caller that must fail before it writes its cache (``MLA``) resolves first and
hands the op the result, which the op then runs as named.

    "auto"     the Triton kernel for CUDA tensors when Triton is installed and the widths and dtype (not
               float64, which the kernel would attend in float32) suit it;
               for CPU tensors the C++ kernel when it runs here and takes the inputs, with at most
               ``AUTO_MAX_QUERY_HEADS`` query heads per sequence (outside ``torch.compile``, which
               traces the torch backend instead); "torch" otherwise
    "naive"    the specification (``naive.py``), a float32 loop
    "torch"    dense latent attention in a few GEMMs, any device (``torch_impl.py``)
    "cpu"      the fused C++ kernel over dense bfloat16 rows (``cpu_kernel.py``)
    "triton"   the fused split-K kernel over the paged cache (``triton_kernel.py``)
"""

from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from ...kv_formats import DenseRows
from ...utils.checked import as_int, is_int
from .cpu_kernel import AUTO_MAX_QUERY_HEADS, cpu_unsupported, cpu_unsupported_for
from .differentiable import recording

DECODE_BACKENDS = ("auto", "naive", "torch", "cpu", "triton")

_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # looked up once, without importing it


def check_backend(backend, name: str = "backend") -> None:
    """ValueError naming ``name`` unless ``backend`` is one of :data:`DECODE_BACKENDS`."""
    if not isinstance(backend, str) or backend not in DECODE_BACKENDS:
        raise ValueError(f"{name}: expected one of {DECODE_BACKENDS}, got {backend!r}")


def triton_installed() -> bool:
    return _TRITON_INSTALLED


# The values Triton reads TRITON_INTERPRET as on (its getenv_bool, any case): "true" ran Triton's interpreter while
# only "1" was read so here, and backend="triton" on CPU tensors was refused, naming TRITON_INTERPRET=1 as the way in
_TRUE = ("1", "true", "on", "yes", "y")


def interpreting() -> bool:
    """Triton runs kernels on CPU tensors only in its interpreter (TRITON_INTERPRET on, as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def triton_unsupported(device: torch.device, d_c: int, d_r: int, dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why the Triton kernel cannot run here (a message naming the argument), or None; ``dtype``: the queries'."""
    if not triton_installed():
        return "backend: 'triton' needs the triton package, which is not installed; use 'torch' or 'auto'"
    if torch.device(device).type != "cuda" and not interpreting():
        return (f"backend: 'triton' runs on CUDA tensors (or in Triton's interpreter, TRITON_INTERPRET=1), "
                f"got {torch.device(device).type} tensors; use 'torch' or 'auto'")
    if not (_is_pow2(d_c) and _is_pow2(d_r) and d_c >= 16 and d_r >= 16):
        return f"q_lat, q_rope: the Triton kernel needs d_c and d_r powers of two >= 16, got {d_c}, {d_r}"
    if dtype == torch.float64:  # its softmax and sums are float32: a float64 decode came back 1.8e-7 off float64's
        return ("q_lat: the Triton kernel attends in float32 and returns a float32 log-sum-exp, got float64 queries; "
                "use 'torch' or 'auto' (the torch backend attends float64 in float64)")
    return None


def _checked_widths(d_c, d_r, names: tuple[str, str]):
    """(d_c, d_r) as ints, or a ValueError naming the one that is not a width (``names``: how the caller's
    arguments call them). The widths pick the backend ("cpu" for d_c=0 was chosen, and failed in the
    kernel's arithmetic); a traced width (a SymInt under torch.compile) is the op's to check."""
    widths = []
    for name, width, low, what in ((names[0], d_c, 1, "the latent width d_c"),
                                   (names[1], d_r, 0, "the RoPE width d_r")):
        width = as_int(width)  # a NumPy int (np.int64 from array arithmetic) is a width
        if not isinstance(width, torch.SymInt) and (not is_int(width) or width < low):
            raise ValueError(f"{name}: expected {what}, an int >= {low}, got {width!r}")
        widths.append(width)
    return tuple(widths)


def select_backend(backend: str, device, d_c: int, d_r: int, dtype: Optional[torch.dtype] = None,
                   kv_format="dense") -> str:
    """The backend that will run, from the device, the widths, the queries' dtype and the row format
    alone (no tensors): ``backend`` itself, or what ``"auto"`` stands for. Without ``dtype``,
    ``"auto"`` does not pick the CPU kernel, and on CUDA it answers for the queries the Triton kernel
    takes (not float64, which it sends to the torch backend when ``dtype`` says so).
    :func:`resolve_backend` also reads the tensors.

    Raises ValueError for an unknown name, or for ``"triton"`` / ``"cpu"`` where the kernel cannot run.
    """
    check_backend(backend)
    d_c, d_r = _checked_widths(d_c, d_r, ("d_c", "d_r"))
    device = torch.device(device)
    quantized = kv_format.quantized if isinstance(kv_format, DenseRows) else kv_format != "dense"
    if backend == "auto":
        if device.type == "cuda":
            return "triton" if triton_unsupported(device, d_c, d_r, dtype) is None else "torch"
        ok = (device.type == "cpu" and dtype is not None and not torch.compiler.is_compiling()
              and cpu_unsupported_for(device, d_c, d_r, dtype, quantized) is None)
        return "cpu" if ok else "torch"
    reason = None
    if backend == "triton":
        reason = triton_unsupported(device, d_c, d_r, dtype)
    elif backend == "cpu":
        reason = cpu_unsupported_for(device, d_c, d_r, dtype, quantized)
        if reason is None and torch.compiler.is_compiling():
            reason = "backend: 'cpu' does not trace under torch.compile; use 'auto' (the torch backend there)"
    if reason is not None:
        raise ValueError(reason)
    return backend


def resolve_backend(backend: str, q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                    scale_cache: Optional[torch.Tensor] = None, softmax_scale=1.0, kv_format="dense",
                    written: Optional[dict] = None) -> str:
    """The backend that runs for these inputs (shapes as ``mla_decode_with_kvcache`` takes them):
    :func:`select_backend`, then what it could not see (the cache's dtype and strides, the scalars'
    dtype, autograd, the query heads per sequence), which sends ``"auto"`` to ``"torch"`` and makes
    a named ``"cpu"`` fail. The same inputs give the same answer, so resolving before a call and
    passing the result changes nothing. ``written``: the rows (name -> tensor) a caller resolving
    before it writes the cache will write, whose autograd the cache then carries."""
    # named as this function's arguments: select_backend's own names (d_c, d_r) are not among them
    _checked_widths(q_lat.shape[-1], q_rope.shape[-1], ("q_lat", "q_rope"))
    chosen = select_backend(backend, q_lat.device, q_lat.shape[-1], q_rope.shape[-1], q_lat.dtype, kv_format)
    if chosen == "triton" and recording(q_lat, q_rope, kv_cache, scale_cache, *(written or {}).values()):
        if backend == "triton":  # the kernel has no backward: autograd would fail after the forward
            raise ValueError("backend: 'triton' has no backward, and autograd records through this call; use "
                             "'auto' or 'torch' to decode with gradients, or decode under torch.no_grad()")
        return "torch"  # its differentiable path (differentiable.py)
    if chosen != "cpu":
        return chosen
    reason = cpu_unsupported(q_lat, q_rope, kv_cache, scale_cache, softmax_scale, written)
    if reason is not None and backend == "cpu":
        raise ValueError(reason)
    # Many query heads per sequence (a wide model, a multi-token append): the torch backend's
    # GEMMs are faster there, so "auto" keeps it.
    too_wide = backend == "auto" and q_lat.shape[1] * q_lat.shape[2] > AUTO_MAX_QUERY_HEADS
    return "torch" if reason is not None or too_wide else "cpu"
