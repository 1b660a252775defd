"""A static-capacity latent cache layer, and the attention over it, for ``torch.compile``.

transformers compiles a decode step only over a cache whose layers say ``is_compileable``
(``StaticLayer``: tensors of a fixed shape allocated once and written in place, a length kept
as a tensor). :class:`StaticLatentCacheLayer` is that for qkmla's latent rows: per layer

    latent     [B, L, d_c + d_r]   rows [c ; k^R] (normalized, rotated RoPE key), column by column
    key_scale  [B, L, G]           the key scalars r (absent without a QK norm)
    key_valid  [B, L] bool         which columns hold a real token (padding is written, never seen)
    length     [] long             columns written so far

with L = ``max_cache_len``. Columns are transformers' columns, padding included, as in its
static cache; attention masks padding through ``key_valid``, and the RoPE positions are the
``position_ids`` transformers passes (for a left-padded ``generate``, each sequence's real
tokens 0, 1, 2, ..., the numbering of qkmla's growing cache).

:func:`static_attend` is the absorbed form (MATH.md) over all L columns with a mask, every
shape fixed by (B, T, L): no ``.item()``, no ``nonzero``, no boolean indexing and no Python
branch on a tensor's value, so one graph serves every decode step. The decode op's score rule
(``ops.mla_decode.naive``) is written out in torch here; its fast backends size their work from
the filled length, which a fixed-shape graph cannot. A prefill into the empty cache (T > 1,
run eagerly by ``generate``) takes the explicit path over the new tokens, as the growing cache
does, unless the attention weights are asked for (``output_attentions``): they are the masked
softmax over the L columns, [B, h, T, L] as transformers' static cache lays them out.

Only dense rows that keep every token fit this shape: another ``kv_format`` or an eviction
policy is refused when the cache is built (:func:`check_static_settings`).
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Optional

import torch
from transformers.cache_utils import CacheLayerMixin

from ...attention.functional import no_decode_gradient
from ...cache.base import WRITER_TOKEN
from ...cache.storage import INFERENCE_ONLY, inference_only, renew, written_only_in_inference_mode
from ...config import MLAConfig
from ...dtypes import cast
from ...utils.checked import FixedSettings, as_int, check_size, is_int
from ...utils.limits import check_allocation
from .view import TransformersView


def check_repeats(repeats) -> None:
    """transformers' ``batch_repeat_interleave(repeats)`` (``num_return_sequences``, contrastive search): a
    ValueError naming ``repeats`` unless it is an int >= 1. 0 emptied the batch (the growing cache's refusal then
    named ``indices``, an argument the caller never gave), and -1 or 2.5 reached torch's repeat_interleave."""
    check_size("repeats", repeats, 1, " (copies of each cached sequence)")


def check_crop(tokens) -> int:
    """transformers' ``crop(tokens)`` (assisted and speculative decoding): ``tokens`` as an int, or a ValueError naming
    it. crop(nan) or crop(2.5) failed in the slicing ("slice indices must be integers"), crop("1") in a comparison."""
    tokens = as_int(tokens)  # a NumPy int is an int
    if not is_int(tokens):
        raise ValueError(f"tokens: expected an int (< 0: drop that many last columns; > 0: keep the first that many; "
                         f"0: nothing), got {tokens!r:.80}")
    return tokens


def check_static_settings(kv_format: str, policy, max_cache_len) -> None:
    """Refuse, naming the argument, what a static latent cache cannot hold."""
    if not is_int(max_cache_len) or max_cache_len < 1:
        raise ValueError(f"max_cache_len: a static latent cache needs a positive int capacity (tokens per "
                         f"sequence, prompt included), got {max_cache_len!r}")
    if kv_format != "dense":
        raise ValueError(f"kv_format: a static (compileable) latent cache stores dense rows, got {kv_format!r}; "
                         f"use kv_format=\"dense\", or a growing cache (static=False) for {kv_format!r}")
    if policy is not None:
        raise ValueError(f"policy: a static (compileable) latent cache keeps every token, so it takes no eviction "
                         f"policy, got {type(policy).__name__}; pass policy=None, or use a growing cache "
                         f"(static=False) with the policy")


class StaticLatentCacheLayer(FixedSettings, TransformersView, CacheLayerMixin):
    """One decoder layer's latent rows in buffers of fixed capacity (module docstring).

    Args:
        config: the attention layer's :class:`~qkmla.MLAConfig` (the row shape).
        max_cache_len: L, the capacity in columns per sequence (prompt, padding and new tokens).

    The buffers are allocated by the first forward (which fixes batch size, device and dtype, as
    transformers' ``StaticLayer.lazy_initialization`` does) and then only written in place.
    """

    is_compileable = True
    is_sliding = False
    is_croppable = True
    supports_early_init = False
    fixed_settings = ("config", "kv_format", "policy", "max_cache_len", "offloading")  # the buffers' shape

    def __init__(self, config: MLAConfig, max_cache_len: int):
        super().__init__()
        check_static_settings("dense", None, max_cache_len)
        self.config, self.max_cache_len = config, max_cache_len
        self.kv_format, self.policy, self.offloading = "dense", None, False
        self.latent: Optional[torch.Tensor] = None
        self.key_scale: Optional[torch.Tensor] = None
        self.key_valid: Optional[torch.Tensor] = None
        with torch.inference_mode(False):  # a layer made under inference mode is still writable outside it
            self.length = torch.tensor(0, dtype=torch.long)  # a tensor: updating it must not recompile

    def __repr__(self) -> str:
        shape = None if self.latent is None else tuple(self.latent.shape)
        return f"StaticLatentCacheLayer(max_cache_len={self.max_cache_len}, latent={shape})"

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, batch_size: int, device, dtype: torch.dtype) -> None:
        """The buffers, zeroed, for ``batch_size`` sequences; a second call checks it is the same batch."""
        if self.latent is not None:
            if batch_size != self.latent.shape[0]:
                raise ValueError(f"cache: it holds {self.latent.shape[0]} sequences and this input has "
                                 f"{batch_size}; a cache serves one batch (pass a new cache, or call cache.reset())")
            if torch.device(device) != self.latent.device or dtype != self.latent.dtype:
                raise ValueError(f"cache: it holds {self.latent.dtype} rows on {self.latent.device}, the model now "
                                 f"runs {dtype} on {device}; pass a new cache")
            # torch's own refusal, at the write, names no cache (not traced: dynamo cannot read is_inference)
            if written_only_in_inference_mode(self.latent):
                raise ValueError(INFERENCE_ONLY)
            return
        c, L = self.config, self.max_cache_len
        if not torch.compiler.is_compiling():  # it reads the machine's free memory: nothing to trace
            check_allocation("max_cache_len", batch_size * L * (c.kv_lora_rank + c.qk_rope_head_dim) * dtype.itemsize,
                             f"{batch_size} sequence(s) of max_cache_len={L} latent rows", device)
        self.latent = torch.zeros(batch_size, L, c.kv_lora_rank + c.qk_rope_head_dim, dtype=dtype, device=device)
        G = c.num_key_scalars
        self.key_scale = torch.zeros(batch_size, L, G, dtype=dtype, device=device) if G else None
        self.key_valid = torch.zeros(batch_size, L, dtype=torch.bool, device=device)
        self.length = self.length.to(device)
        self.device, self.is_initialized = self.latent.device, True
        if not torch.compiler.is_compiling():  # fixed addresses: in-place writes then need no new graph
            for t in (self.latent, self.key_scale, self.key_valid, self.length):
                if t is not None:
                    torch._dynamo.mark_static_address(t)

    def rows_by_column(self) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """(latent [B, L, d_c + d_r], key scalars [B, L, G] or None, ``key_valid`` [B, L]): the
        buffers as they are, every column (for :class:`~.view.TransformersView`)."""
        return self.latent, self.key_scale, self.key_valid

    def check_writer(self, attn) -> None:
        """A ValueError unless this layer is empty or holds ``attn``'s rows, as the growing cache's
        (:meth:`~qkmla.cache.base.SequenceCache.check_writer`): a static cache filled by one model and handed to
        another of the same shape took its columns as the other's tokens, without a word (the growing cache
        refused it). An empty layer (new, reset, cropped to nothing) takes any layer; copies of a layer (deepcopy,
        pickle) keep its token. Not checked while torch.compile traces (eager calls only, as check_room)."""
        if torch.compiler.is_compiling():
            return
        token = vars(attn).setdefault(WRITER_TOKEN, secrets.randbits(63))
        held = self.__dict__.get("writer")
        if held == token:  # the usual case, without reading the length (a device sync per layer and step)
            return
        if held is None or int(self.length) == 0:
            self.writer = token
        else:
            raise ValueError(f"cache: it holds another attention layer's rows ({int(self.length)} columns), written "
                             f"by another model or layer; each model needs a cache of its own "
                             f"(LatentAttentionCache(model, ...)); cache.reset() empties this one for another, "
                             f"cache.release_writer() hands its rows to the next model that writes (the same "
                             f"weights, rebuilt)")

    def check_room(self, num_tokens: int) -> None:
        """Refuse, before any write, ``num_tokens`` more columns than the capacity leaves (eager
        calls only: a compiled step cannot read the length)."""
        if torch.compiler.is_compiling():
            return
        needed = int(self.length) + num_tokens
        if needed > self.max_cache_len:
            raise ValueError(f"max_cache_len: this static latent cache holds {self.max_cache_len} columns per "
                             f"sequence and this call needs {needed}; generate with a larger max_length, or build "
                             f"LatentAttentionCache(model, max_cache_len=N, static=True) with a larger N")

    # -- transformers' cache-layer interface ----------------------------------------------------

    def lazy_initialization(self, key_states, value_states) -> None:
        raise ValueError("cache: a StaticLatentCacheLayer is allocated by qkmla's attention on its first forward, "
                         "not from key/value shapes")

    def update(self, *args, **kwargs):
        raise ValueError("cache: this layer holds qkmla latent rows, written by qkmla's attention only; a "
                         "transformers attention layer cannot use it (call "
                         "qkmla.integrations.transformers.apply_latent_attention on the model)")

    def get_seq_length(self, *args):
        """Columns written so far: a 0-dim tensor once allocated, as transformers' ``StaticLayer`` gives."""
        return self.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    get_max_cache_shape = get_max_length

    @property
    def batch_size(self) -> int:
        if self.latent is None:
            raise AttributeError("batch_size: not allocated yet")
        return self.latent.shape[0]

    @property
    def max_batch_size(self) -> int:
        """The batch size the buffers hold, 0 before the first forward (transformers before 5.2x
        reads it to decide whether ``generate`` may reuse its static cache)."""
        return 0 if self.latent is None else self.latent.shape[0]

    @property
    def bytes_per_token(self) -> int:
        """Bytes one column occupies in this layer (0 before the first forward)."""
        if self.latent is None:
            return 0
        scale = self.key_scale.shape[-1] * self.key_scale.element_size() if self.key_scale is not None else 0
        return self.latent.shape[-1] * self.latent.element_size() + scale

    def reset(self) -> None:
        """Forget every token; the buffers (and batch size) stay, without the autograd history of rows a
        training step wrote (kept, the next step's writes chained onto the freed graph of the last, and
        its backward failed with "Trying to backward through the graph a second time"). In place: the
        buffers keep the addresses a compiled decode step was built for, except buffers made under
        torch.inference_mode() reset outside it, which only inference mode may write: new ones, so that
        reset() is the way out the refusal in :meth:`allocate` names (:func:`~qkmla.cache.storage.renew`)."""
        self.attention = None  # the next layer that writes is the one the transformers view expands keys with
        for name in ("latent", "key_scale", "key_valid", "length"):
            if renew(self, name):  # new, zeros
                if self.is_initialized:
                    torch._dynamo.mark_static_address(getattr(self, name))
            elif getattr(self, name) is not None:
                getattr(self, name).zero_()

    def crop(self, tokens: int) -> None:
        """Drop the last ``-tokens`` columns (tokens < 0) or keep the first ``tokens`` (> 0)."""
        tokens = check_crop(tokens)
        current = int(self.length)
        keep = current + tokens if tokens <= 0 else min(tokens, current)
        if keep >= current:  # nothing to drop: taken under any mode, as the growing cache takes it
            return
        self._check_writable("crop it")
        self.key_valid[:, max(keep, 0):].zero_()
        self.length.fill_(max(keep, 0))

    def _check_writable(self, action: str) -> None:
        """A ValueError before an in-place write (crop, reorder_cache) to buffers made under torch.inference_mode()
        and written outside it: torch refused it naming no cache ("Inplace update to inference tensor outside
        InferenceMode is not allowed"). Not traced (dynamo cannot read the inference flag)."""
        if self.latent is not None and written_only_in_inference_mode(self.latent):
            raise ValueError(inference_only(action))

    def _buffers(self) -> list:
        return [t for t in (self.latent, self.key_scale, self.key_valid) if t is not None]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows picked by ``beam_idx``, written in place (the buffers keep their addresses)."""
        if self.latent is None:
            return
        self._check_writable("reorder it")
        beam_idx = beam_idx.to(self.latent.device)
        for t in self._buffers():
            t.copy_(t.index_select(0, beam_idx))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.latent is not None:
            indices = indices.to(self.latent.device)
            self.latent, self.key_valid = self.latent[indices], self.key_valid[indices]
            self.key_scale = self.key_scale[indices] if self.key_scale is not None else None

    def batch_repeat_interleave(self, repeats: int) -> None:
        check_repeats(repeats)
        if self.latent is not None:
            held = sum(t.numel() * t.element_size() for t in self._buffers())
            check_allocation("repeats", held * repeats, f"{repeats} copies of the {self.latent.shape[0]} cached "
                             f"sequence(s) of max_cache_len={self.latent.shape[1]}", self.latent.device)
            self.latent = self.latent.repeat_interleave(repeats, dim=0)
            self.key_valid = self.key_valid.repeat_interleave(repeats, dim=0)
            self.key_scale = self.key_scale.repeat_interleave(repeats, dim=0) if self.key_scale is not None else None

    def offload(self) -> None:  # transformers calls these around layers of an offloading cache only
        pass

    def prefetch(self) -> None:
        pass

    # -- what the attention calls -------------------------------------------------------------

    def write(self, columns: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor,
              key_scale: Optional[torch.Tensor], valid: torch.Tensor) -> None:
        """Store the new tokens' rows at ``columns`` [T] (c [B, T, d_c], k^R [B, T, d_r], r [B, T, G]
        or None, ``valid`` [B, T] bool) and count them."""
        self.latent.index_copy_(1, columns, torch.cat((c_kv, k_rope), dim=-1).to(self.latent.dtype))
        if self.key_scale is not None:
            self.key_scale.index_copy_(1, columns, key_scale.to(self.key_scale.dtype))
        self.key_valid.index_copy_(1, columns, valid)
        self.length.add_(columns.shape[0])


def _key_rows(attn, c_kv: torch.Tensor, k_r: torch.Tensor, w_uk: torch.Tensor):
    """(k~^R normalized, not yet rotated; key scalars [B, T, G] or None): ``absorbed.key_scalars``
    written with one einsum for the content keys (that function's op may run qkmla's CPU kernel,
    which a compiled graph does not trace)."""
    k_norm = attn.k_norm
    if k_norm is None:
        return k_r, None
    k_c = torch.einsum("btc,gnc->btgn", c_kv, cast(w_uk, c_kv.dtype))  # [B, T, G, d_n]
    sigma, sigma_r = k_norm.statistics(k_c, k_r)
    if k_norm.mode == "blockwise":
        return k_norm.rope.scaled(k_r, sigma_r), sigma.squeeze(-1)
    return k_r * cast(k_norm.rope.weight, k_r.dtype), sigma.squeeze(-1)


def _absorbed_weights(attn):
    """The layer's absorbed weights: re-checked against their sources in eager calls; a compiled
    step reads the ones kept (the prefill, eager, derived them), since the check reads version
    counters and storage addresses, which a graph cannot. A compiled step that autograd records
    through (training mode, a prefill run under no_grad) derives them afresh, as an eager one does:
    the kept ones, derived without autograd, left kv_b_proj and the norm weights without a gradient."""
    kept = attn._absorbed.weights
    if torch.compiler.is_compiling() and kept is not None and not attn.records_weight_gradients():
        return kept
    return attn.step_weights()  # in training mode, with autograd: derived afresh, so kv_b_proj gets its gradient


def static_attend(attn, layer: StaticLatentCacheLayer, x: torch.Tensor, valid: Optional[torch.Tensor],
                  position_ids: Optional[torch.Tensor], weights: bool = False):
    """``attn`` (a LatentAttention) over ``layer``'s columns and x's new ones, x's rows written.

    Args:
        x: [B, T, hidden_size].
        valid: [B, T] bool (False: padding) or None (all real).
        position_ids: [B, T] or [1, T], transformers' positions; None: the column numbers.
        weights: also return the attention weights (``output_attentions=True``).

    Returns:
        (output [B, T, hidden_size], a padding query attending to the real tokens before it (zeros
        where there is none), as transformers' attention; the attention weights
        [B, h, T, L] in transformers' static-cache layout, one column per cache column, unwritten
        and padding columns 0, a padding query's row the one its output is computed from, if
        ``weights``, else None).
    """
    B, T = x.shape[:2]
    layer.allocate(B, x.device, x.dtype)
    layer.check_room(T)
    layer.check_writer(attn)
    # Asked for the weights, the prefill too takes the absorbed form over the columns: its
    # probabilities are the weights, laid out as transformers' static cache lays them out.
    prefill = T > 1 and not weights and not torch.compiler.is_compiling() and int(layer.length) == 0
    columns = layer.length + torch.arange(T, device=x.device)  # [T]
    positions = (position_ids if position_ids is not None else columns[None]).to(x.device).expand(B, T)
    real = valid if valid is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
    # In eval mode a step over the columns is inference, also outside torch.no_grad (as MLA's own decode
    # step): no graph kept in the buffers, and a backward that says so. The explicit prefill keeps its graph.
    inference = not prefill and not attn.training and torch.is_grad_enabled()
    with torch.no_grad() if inference else contextlib.nullcontext():
        w = _absorbed_weights(attn)
        c_kv, k_r = attn.latent(x)
        k_r, key_scale = _key_rows(attn, c_kv, k_r, w.w_uk)
        layer.write(columns, c_kv, attn.rotary(k_r, positions).squeeze(2), key_scale, real)
        probs = None
        if prefill:  # the explicit path over the new tokens alone, as the growing cache's prefill
            out, _ = attn._uncached(x, valid, positions)
        else:
            heads, probs = _attend_columns(attn, layer, x, positions, columns, w)
            out = attn.project_out(heads, x)
    if inference:
        out = no_decode_gradient(out, x, attn)
    # A padding query keeps what transformers' attention gives it (the real tokens before it; 0 with none): zeroed,
    # a right-padded generate over a static cache took its first new token from a padding column's zeros
    if not weights:
        return out, None
    return out, probs.to(x.dtype)  # a padding query's row is its output's (weights.py), 0 where it sees nothing


def _attend_columns(attn, layer: StaticLatentCacheLayer, x: torch.Tensor, positions: torch.Tensor,
                    columns: torch.Tensor, w) -> tuple[torch.Tensor, torch.Tensor]:
    """The absorbed form over all L columns, masked: (heads' outputs [B, T, h, d_v], the
    probabilities [B, h, T, L], which the outputs are computed from; 0 for a query that sees nothing,
    whose output is 0).

    Query t (column columns[t]) sees column j when j <= columns[t] and j holds a real token; a padding
    query with none sees its own column only so that no row of the softmax is empty, and its output is
    0 (transformers' attention gives those 0, and the real tokens before it to the others). The
    score rule is the decode op's (``ops.mla_decode.naive``), in float32 (float64 for float64)."""
    from ...attention.absorbed import latent_query, values_out

    c = attn.config
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    q_lat, q_rope = latent_query(*attn.raw_query(x), attn.q_norm, w)  # [B, T, h, d_c], [B, T, h, d_r]
    q_rope = attn.rotary(q_rope, positions)
    latent, key_scale = layer.latent, layer.key_scale
    # Autograd saves the rows for the backward, and the next step writes the buffers in place: read as they were
    # (``.to(acc)`` returns the buffer itself in float32 and float64), a training step over two decode steps
    # failed in its backward ("Output 0 of ReshapeAlias is a view and its base ... has been modified inplace").
    # One copy (bf16 rows are copied by the cast anyway), as MLA.expand_cache does; a step under no_grad
    # (inference) reads the buffers as they are.
    copy = torch.is_grad_enabled()
    cached, k_rope = latent.to(acc, copy=copy).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)  # [B, L, *]
    s_c = torch.einsum("bthc,blc->bhtl", q_lat.to(acc), cached)
    s_r = torch.einsum("bthr,blr->bhtl", q_rope.to(acc), k_rope)
    scale = attn.scale
    scale = scale.to(acc).view(1, -1, 1, 1) if isinstance(scale, torch.Tensor) else scale
    if key_scale is not None:
        r = key_scale.to(acc, copy=copy).transpose(1, 2)  # [B, G, L]
        r = r.repeat_interleave(c.num_heads // r.shape[1], dim=1)[:, :, None, :]  # [B, h, 1, L]
        scores = scale * (r * s_c + s_r) if attn.score_mode == "blockwise" else scale * r * (s_c + s_r)
    else:
        scores = scale * (s_c + s_r)
    j = torch.arange(layer.max_cache_len, device=x.device)
    own = j[None, :] == columns[:, None]  # [T, L]
    seen = (j[None, :] <= columns[:, None]) & layer.key_valid[:, None, :]  # [B, T, L]
    empty = ~seen.any(dim=-1)  # [B, T]: padding queries with no real token at or before them
    visible = seen | (own & empty[..., None])  # a real query's own column is in seen already
    probs = scores.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1)
    o_lat = torch.einsum("bhtl,blc->bthc", probs, cached).to(x.dtype)
    empty_rows = empty[:, None, :, None]  # [B, 1, T, 1]
    return values_out(o_lat, w).masked_fill(empty[..., None, None], 0.0), probs.masked_fill(empty_rows, 0.0)
