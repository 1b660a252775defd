"""DeepSeek's sparse attention (DSA, DeepSeek-V3.2) over qkmla's latent cache.

transformers' ``DeepseekV32Attention`` is MLA plus a lightning indexer that picks, for each query,
the ``index_topk`` cached tokens it attends to. transformers then re-expands **every** cached
latent through ``kv_b_proj`` and masks out all keys but the chosen ones. :class:`SparseLatentAttention`
keeps the indexer (transformers' own module and its own small key cache, held by
:class:`~.sparse_cache.SparseLatentCacheLayer`) and hands its choice to qkmla's MLA as a selection of
latent cache slots:

    decode (cached tokens)   the absorbed decode op with ``indices`` [B, T, topk]: it reads only the
                             chosen rows and, with a QK norm, their key scalars (gathered with the
                             same indices); a prefill chunk over a context short against topk is
                             expanded instead, where that costs fewer multiply-adds
                             (``paths.cheaper_cached_path``)
    prefill (empty cache)    the explicit path, keys outside the selection masked
    no cache                 the explicit path over the call's tokens, the indexer's mask as above

The indexer is given the mask transformers would give it: causal, padding columns out; it returns
columns of that mask, which :func:`~.sparse_cache.column_slots` turns into slots (padding is not
cached). transformers' position embeddings (cos, sin) reach the indexer as they come, so it rotates
its keys exactly as in the unpatched model.

Families (``families.FAMILIES``, build "sparse"): DeepSeek-V3.2's, GLM-5's DSA (``glm_moe_dsa``),
whose attention is V3.2's with cross-layer top-k sharing (``HostAttention.shared_topk``): a "shared"
layer has no indexer and attends to the previous layer's choice (``prev_topk_indices``, columns of
the same mask, so the same slots), and every layer returns its choice as a third output; and
HY-V4's (``hy_v4``), GLM-5's with attention sinks (``HostAttention.attention_sinks``: ``MLA.sinks``
on every path, ``qkmla.attention.sinks``) and a per-channel output gate (``project_out``); and AXK2's
(``axk2``), whose query and per-channel output gate come from one fused projection (``q_gate_proj``,
read by ``LatentAttention.raw_query`` and ``project_out``). The
indexer is called as V3.2's is; one with another call (transformers 5.4's GLM indexer, which keeps
its keys on the module) is refused, naming its class.

Not supported here, refused with the reason: an eviction policy, the static cache, ``output_attentions``
and packed sequences with a cache (as for every latent layer).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from ...attention.functional import sdpa
from ...attention.mla import MLA
from ...attention.paths import cheaper_cached_path
from .attention import LatentAttention, LatentCall, LatentSettings, check_host_position_ids, rope_positions
from .sparse_cache import column_slots, sparse_cache_layer


# The indexer's call, as sparse.py makes it, by position (V3.2's DeepseekV32Indexer.forward; GLM-5's since
# 5.19); the cache's name is the transformers version's: past_key_values before 5.2x, cache since
INDEXER_ARGUMENTS = ("hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids")
CACHE_NAMES = ("cache", "past_key_values")


def is_sparse(hf_attention) -> bool:
    """Whether a transformers MLA attention layer has DeepSeek's sparse attention: a lightning indexer,
    or (GLM-5's "shared" layers) an ``indexer`` of None, the layer reusing the previous one's top-k."""
    return getattr(hf_attention, "indexer", None) is not None or getattr(hf_attention, "skip_topk", False)


def check_indexer(indexer) -> None:
    """Refuse an indexer that is not called as V3.2's (``INDEXER_ARGUMENTS``), naming its class."""
    names = tuple(inspect.signature(type(indexer).forward).parameters)[1:]
    own_keys = hasattr(indexer, "_cached_keys")  # transformers 5.4's GLM-5 indexer
    n = len(INDEXER_ARGUMENTS)
    if names[:n] != INDEXER_ARGUMENTS or names[n:n + 1] not in [(c,) for c in CACHE_NAMES] or own_keys:
        how = "keeps its keys on the module (_cached_keys)" if own_keys else f"takes {names}"
        raise ValueError(f"hf_attention: its indexer {type(indexer).__name__} {how}, which the sparse adapter does "
                         f"not call: it calls DeepSeek-V3.2's {INDEXER_ARGUMENTS} and the cache, "
                         f"its keys in the cache (cache.update_indexer); upgrade transformers (GLM-5's DSA: 5.19 "
                         f"or later)")


class SparseLatentAttention(LatentAttention):
    """transformers' ``DeepseekV32Attention``, computed by qkmla; ``indexer`` is transformers' own module.

    Args: those of :class:`~.attention.LatentAttention`, and
        indexer: the layer's lightning indexer (``DeepseekV32Indexer``): called as transformers calls it,
            ``indexer(hidden_states, q_resid, position_embeddings, mask [B, T, C], position_ids, cache=)``
            -> chosen columns [B, T, topk]; None for a layer that reuses the previous layer's choice
            (``host.shared_topk``: GLM-5's "shared" layers).
    """

    # (x, its query latent) while a call runs: the indexer and the query share one q_a_proj, as in
    # transformers' own layer, rather than projecting the hidden states twice (query_latent)
    _query_input: Optional[tuple] = None

    def __init__(self, config, layer_idx: int, projections: Optional[dict] = None,
                 settings: Optional[LatentSettings] = None, host=None, g_proj: Optional[torch.nn.Module] = None,
                 indexer: Optional[torch.nn.Module] = None):
        super().__init__(config, layer_idx, projections, settings, host, g_proj)
        if config.q_lora_rank is None:
            raise ValueError("hf_attention: DeepSeek's indexer reads the query's low-rank residual (q_a_proj, "
                             "q_a_layernorm), so its attention needs q_lora_rank; this config has none")
        self.indexer = indexer

    @classmethod
    def from_hf(cls, hf_attention, settings: Optional[LatentSettings] = None, hf_rotary=None,
                host=None, **overrides) -> "SparseLatentAttention":
        """The qkmla layer for an HF sparse attention layer, sharing its weights and adopting its
        indexer as it is (transformers keeps the indexer's ``weights_proj`` in float32 in a
        bfloat16 model; its dtypes are left alone)."""
        if not is_sparse(hf_attention):
            raise ValueError(f"hf_attention: a {type(hf_attention).__name__} has no indexer (not sparse attention); "
                             f"use LatentAttention.from_hf")
        if settings is not None and settings.policy is not None:
            raise ValueError("policy: a sparse attention model's indexer selects among every cached token, so its "
                             "latent cache cannot evict tokens; patch it with policy=None")
        indexer = getattr(hf_attention, "indexer", None)
        if indexer is not None:
            check_indexer(indexer)
        elif host is None or not host.shared_topk:
            raise ValueError(f"hf_attention: a {type(hf_attention).__name__} without an indexer reuses the previous "
                             f"layer's top-k, which its family's row does not say (HostAttention.shared_topk)")
        with _without_indexer(hf_attention):  # the projections alone set the layer's dtype and device
            layer = super().from_hf(hf_attention, settings, hf_rotary, host, **overrides)
        layer.indexer = indexer
        return layer

    def with_norm(self, norm) -> "SparseLatentAttention":
        indexer = self.indexer
        with _without_indexer(self):
            layer = super().with_norm(norm)
        layer.indexer = indexer
        return layer

    def query_latent(self, x: torch.Tensor) -> torch.Tensor:
        """MLA's c^Q of ``x``: the one the indexer was given in this call when ``x`` is that call's
        input itself (a padded batch's rows reach MLA reordered and zeroed: computed again)."""
        given = self._query_input
        return given[1] if given is not None and given[0] is x else super().query_latent(x)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None, **kwargs):
        """transformers' attention call: ``hidden_states`` [B, T, hidden_size] -> (output [B, T, hidden_size],
        None), and the chosen columns [B, T, topk] third where the family shares its top-k across layers
        (``host.shared_topk``; a layer without an indexer takes ``prev_topk_indices``).

        ``position_embeddings`` (transformers' cos, sin) go to the indexer; ``attention_mask``
        (transformers' own, None under ``apply_latent_attention``) is not read: the indexer's mask
        is built from ``qkmla_call`` and the cache's record of padding.
        """
        out, chosen = self._attend(hidden_states, position_embeddings, kwargs)
        return (out, None, chosen) if self.host.shared_topk else (out, None)

    def _choose(self, x, q_resid, position_embeddings, visible, position_ids, cache, previous):
        """The columns each new token attends to [B, T, topk]: this layer's indexer's choice, or the
        previous layer's (``previous``, GLM-5's "shared" layers: the same columns, the same mask)."""
        if self.indexer is not None:
            # the cache by position: its name is the transformers version's (CACHE_NAMES)
            return self.indexer(x, q_resid, position_embeddings, visible, position_ids, cache)
        if previous is None:
            raise ValueError("prev_topk_indices: this layer reuses the previous layer's top-k (its family's "
                             "indexer_types say 'shared'), and got none; the first layer must have an indexer")
        return previous.to(x.device)

    def _attend(self, hidden_states: torch.Tensor, position_embeddings, kwargs):
        """``forward``'s work: (output [B, T, hidden_size], chosen columns [B, T, topk])."""
        cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value") if kwargs.get(k) is not None),
                     None)
        x = hidden_states
        call = kwargs.get("qkmla_call") or LatentCall()
        if call.attentions is not None:
            raise ValueError("output_attentions: the attention weights of a sparse attention model patched by "
                             "apply_latent_attention are not returned; call without output_attentions")
        if position_embeddings is None:
            raise ValueError("position_embeddings: DeepSeek's indexer rotates with transformers' (cos, sin), which "
                             "the decoder layer passes; got None")
        valid = call.valid.to(x.device) if call.valid is not None else None
        documents = call.documents.to(x.device) if call.documents is not None else None
        position_ids = kwargs.get("position_ids")
        check_host_position_ids(position_ids, x.dtype)
        self.check_no_dropout("sparse attention", "build the model with attention_dropout=0.0, or model.eval()")
        B, T = x.shape[:2]
        q_resid = super().query_latent(x)  # the indexer's query input, as transformers computes it
        new = valid if valid is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
        previous = kwargs.get("prev_topk_indices")
        self._query_input = (x, q_resid)
        try:
            return self._attend_cached(x, q_resid, position_embeddings, position_ids, valid, documents, new,
                                       previous, cache)
        finally:
            self._query_input = None

    def _attend_cached(self, x, q_resid, position_embeddings, position_ids, valid, documents, new, previous, cache):
        """:meth:`_attend` once its arguments are read: the uncached path, or the cache's."""
        B, T = x.shape[:2]
        if cache is None:
            return self._uncached_sparse(x, q_resid, position_embeddings, position_ids, valid, documents, new,
                                         previous)
        if documents is not None:
            raise ValueError("cache: this call packs several sequences into a batch row, which a cache (one "
                             "sequence per row) cannot hold; call without a cache")
        layer = sparse_cache_layer(cache, self.layer_idx, self.config, self.settings.kv_format, self.settings.policy)
        latent = layer.reserve(B, T, x.device, x.dtype, self.config)
        columns = torch.cat((layer.stored, new.to(layer.stored.device)), dim=1).to(x.device)  # [B, C + T]
        visible = _causal(T, columns.shape[1], x.device) & columns[:, None, :]  # [B, T, C + T]
        before = layer.columns
        try:
            chosen = self._choose(x, q_resid, position_embeddings, visible, position_ids, cache, previous)
            indices = column_slots(columns, visible, chosen)  # [B, T, topk]
            positions = rope_positions(position_ids, self.settings.policy, B, T)  # transformers' own, as attention.py
            # The selection is distinct slots within each sequence (column_slots), so expanding the
            # cache gives the absorbed path's answer; a prefill chunk over a context short against
            # topk is cheaper expanded (paths.cheaper_cached_path), a decode step never is
            path = "auto" if latent.max_len == 0 else cheaper_cached_path(self.config, T, latent.max_len,
                                                                          indices.shape[-1])
            if valid is None:
                out = MLA.forward(self, x, latent, indices=indices, rope_positions=positions, path=path)
            else:  # real tokens first (right padding), their selections and positions with them
                order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
                index = order[..., None].expand_as(x)
                moved = indices.gather(1, order[..., None].expand_as(indices))
                compacted = positions.to(order.device).gather(1, order) if positions is not None else None
                out = MLA.forward(self, x.gather(1, index), latent, input_lengths=valid.sum(dim=1), indices=moved,
                                  rope_positions=compacted, path=path)
                out = torch.empty_like(out).scatter_(1, index, out).masked_fill(~valid[..., None], 0.0)
                out = self._chosen_padding_queries(x, valid, latent, positions, indices, out)
        except BaseException:
            layer.drop_indexer_columns(before)  # the latent cache took its rows out again (its transaction)
            raise
        layer.advance(valid, B, T)
        return out, chosen

    def _chosen_padding_queries(self, x: torch.Tensor, valid: torch.Tensor, latent, positions, indices: torch.Tensor,
                                out: torch.Tensor) -> torch.Tensor:
        """``out`` with each padding query that chose a real token given what transformers' sparse attention
        gives it: attention over the slots its indexer chose (``indices`` [B, T, topk], -1 none), after this
        call's real tokens went in. Their output was 0, and a right-padded ``generate`` picks its first new
        token from the last column's logits, a padding one: DeepSeek-V3.2 generated other tokens than
        transformers. As ``LatentAttention._padding_queries``: not where the positions are not transformers' or an
        eviction policy may have moved the slots; decode steps (no padding) never pay it."""
        queried = ~valid & (indices >= 0).any(dim=-1)  # [B, T]
        if positions is None or self.settings.policy is not None or not bool(queried.any()):
            return out
        k, v = self.expand_cache(*latent.load())  # [B, S, G, d_n + d_r], [B, S, G, d_v]
        S = k.shape[1]
        slots = torch.where(indices >= 0, indices, S).to(x.device)  # none: a column past the cache, cut off
        mask = torch.zeros(*indices.shape[:2], S + 1, dtype=torch.bool, device=x.device).scatter_(-1, slots, True)
        q = self.explicit_query(x, positions.to(x.device).expand(x.shape[0], x.shape[1]))
        heads = sdpa(q, k, v.to(q.dtype), self.scale, mask=mask[..., :S], sinks=self.sinks)
        return torch.where(queried[..., None], self.project_out(heads.to(x.dtype), x), out)

    def _uncached_sparse(self, x, q_resid, position_embeddings, position_ids, valid, documents, new, previous=None):
        """The explicit path over x alone (training, scoring): each token attends to the indexer's
        choice among the tokens before it in its sequence. -> ([B, T, hidden_size], chosen [B, T, topk])."""
        B, T = x.shape[:2]
        visible = _causal(T, T, x.device) & new[:, None, :]
        if documents is not None:
            visible = visible & (documents[:, :, None] == documents[:, None, :])
        chosen = self._choose(x, q_resid, position_embeddings, visible, position_ids, None, previous)
        mask = torch.zeros_like(visible).scatter_(-1, chosen.long(), True) & visible
        # A padded query attends to its indexer's choice among the real tokens before it, as transformers' does,
        # and one with none gives 0 (sdpa's empty row). It used to see itself too (its logits are read: a
        # right-padded generate(use_cache=False) picks its first new token from a padding column's), and before
        # that every real token did (logits 0.17 from transformers', the unpadded rows' too).
        positions = (position_ids if position_ids is not None else torch.arange(T, device=x.device)).expand(B, T)
        q, k, v = self.explicit_qkv(x, positions.to(x.device))
        return self.project_out(sdpa(q, k, v, self.scale, mask=mask, sinks=self.sinks), x), chosen


class _without_indexer:
    """Within it, ``module`` has no ``indexer`` submodule (put back after, whatever happens), so that
    building or copying the layer from its projections leaves the indexer as it is (transformers keeps
    its ``weights_proj`` in float32 in a bfloat16 model)."""

    def __init__(self, module):
        self.module = module

    def __enter__(self):
        self.indexer = self.module._modules.pop("indexer", None)  # None: no module (a "shared" layer's)
        return self.module

    def __exit__(self, *exc):
        if self.indexer is not None:
            self.module._modules["indexer"] = self.indexer
        return False


def _causal(T: int, C: int, device) -> torch.Tensor:
    """[T, C] bool: new token t (column C - T + t) sees columns 0..C - T + t."""
    return torch.arange(C, device=device)[None, :] <= torch.arange(C - T, C, device=device)[:, None]
