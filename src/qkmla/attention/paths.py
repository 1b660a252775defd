"""Which of MLA's three paths a forward call takes, settled (and its arguments checked)
before any work starts.

    explicit   no cache, a full-key cache, or a prefill into an empty latent cache
    absorbed   decode over a latent cache (the default once it holds tokens)
    expand     the HF-style baseline: re-expand every cached key at every step

Once the cache holds tokens, "auto" takes the absorbed path: its workspace is bounded, and it
counts a slot that a selection (``indices``) lists twice as often as listed, as the decode op
does. :func:`cheaper_cached_path` says which of absorbed and expand costs fewer multiply-adds for
a call. A caller whose calls it knows may choose with it. The transformers adapter's sparse
attention does so for its prefill chunks: their selections are distinct slots within each
sequence, and it expands only where the context is short against topk, so the expanded keys stay
small. That is vLLM's split of MLA into a compute-friendly prefill and a memory-friendly decode.
The count leaves out memory traffic and the expanded keys' bytes. With KV groups G < h, the
expansion is cheap in multiply-adds but not in time.
"""

from __future__ import annotations

from typing import Optional

from ..cache.full import FullKVCache
from ..cache.latent import LatentCache
from .functional import check_cache_device, check_hidden
from .selection import check_selection

PATHS = ("auto", "explicit", "absorbed", "expand")


def cheaper_cached_path(config, new_tokens: int, cached: int, keys_per_query: Optional[int] = None) -> str:
    """"absorbed" or "expand", whichever costs fewer multiply-adds for ``new_tokens`` queries over a
    latent cache holding ``cached`` tokens before the call (module docstring); ``keys_per_query``:
    a top-k selection's topk (None: every visible key).

    Per call, with h heads, G KV groups and the new tokens' keys K = cached + T:
        absorbed  T h (d_n d_c + d_c d_v)            absorb W_UK into the queries, W_UV after
                  + T h k (2 d_c + d_r)              scores over [c; k^R], values read from c
        expand    K G d_c (d_n + d_v)                up-project every cached latent
                  + T h K (d_n + d_r + d_v)          scores and values over the expanded keys
    with k = min(keys_per_query, K) the keys each query reads. Ties stay absorbed.
    """
    c = config
    T, h, G = new_tokens, c.num_heads, c.num_kv_groups
    d_c, d_r, d_n, d_v = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    keys = cached + T
    read = keys if keys_per_query is None else min(keys_per_query, keys)
    absorbed = T * h * (d_n * d_c + d_c * d_v) + T * h * read * (2 * d_c + d_r)
    expand = keys * G * d_c * (d_n + d_v) + T * h * keys * (d_n + d_r + d_v)
    return "expand" if expand < absorbed else "absorbed"


def resolve_path(mla, x, cache, path: str, input_lengths, indices=None) -> str:
    """Check the arguments of ``mla(x, cache, path=path, input_lengths=..., indices=...)``; return
    the path it takes ("auto" resolved)."""
    c = mla.config
    check_hidden(x, c.hidden_size, mla.o_proj.weight.dtype, mla.o_proj.weight.device)
    if path not in PATHS:
        raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
    if cache is not None and not isinstance(cache, (LatentCache, FullKVCache)):
        raise ValueError(f"cache: expected a LatentCache, a FullKVCache or None, got {type(cache).__name__}")
    if cache is not None:
        cache.check_config(c)
        check_cache_device(cache, x)
    if indices is not None:
        check_selection(indices, x, cache)
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
