"""Which of MLA's three paths a forward call takes, settled (and its arguments checked)
before any work starts.

    explicit   no cache, a full-key cache, or a prefill into an empty latent cache
    absorbed   decode over a latent cache (the default once it holds tokens)
    expand     the HF-style baseline: re-expand every cached key at every step
"""

from __future__ import annotations

from ..cache.full import FullKVCache
from ..cache.latent import LatentCache
from .functional import check_hidden

PATHS = ("auto", "explicit", "absorbed", "expand")


def resolve_path(mla, x, cache, path: str, input_lengths) -> str:
    """Check the arguments of ``mla(x, cache, path=path, input_lengths=...)``; return the
    path it takes ("auto" resolved)."""
    c = mla.config
    check_hidden(x, c.hidden_size, mla.o_proj.weight.dtype)
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    if cache is not None and not isinstance(cache, (LatentCache, FullKVCache)):
        raise ValueError(f"cache: expected a LatentCache, a FullKVCache or None, got {type(cache).__name__}")
    if cache is not None:
        cache.check_config(c)
    if not isinstance(cache, LatentCache):
        if path not in ("auto", "explicit"):
            raise ValueError(f"path: {path!r} reads a latent cache; pass cache=LatentCache(...) or use 'explicit'")
        if cache is None and input_lengths is not None:
            raise ValueError("input_lengths: only meaningful with a cache (padding is not written)")
        return "explicit"
    if path == "auto":
        return "explicit" if cache.max_len == 0 and x.shape[1] > 1 else "absorbed"
    if path == "explicit" and cache.max_len != 0:
        raise ValueError("path: 'explicit' with a latent cache is only a prefill into an empty cache; "
                         "use 'absorbed' or 'expand' to attend over cached tokens")
    return path
