"""Multi-head Latent Attention with post-up-projection QK normalization.

One module, three ways to attend (MATH.md names throughout):

* **explicit** (training, prefill): materialize q and k, normalize them, one
  ``scaled_dot_product_attention`` call. Parameter names are DeepSeek's/HF's
  (``q_a_proj``, ``kv_b_proj``, ...), so an HF state dict loads as is.
* **absorbed** (decode): the query moves into latent space with both norm weights folded
  in, q_lat = rho(q^C) (q^C ⊙ gamma_q^C ⊙ gamma_k^C) W_UK^T (gamma_k^C moves to the query
  side because gamma_k ⊙ (c W_UK) = c W_UK diag(gamma_k)); the content score is
  q_lat . c_j scaled by the cached key scalar r_{j,g}; values go through W_UV after
  the softmax. The cache holds [c ; kh^R] and G scalars per token (:class:`LatentCache`).
* **expand** (the HF-style baseline): read the latent cache and re-expand every key with
  W_UK at every step.

Absorbed weights are derived from ``kv_b_proj`` and the norm weights on first use and
kept; they are recomputed whenever one of those parameters changes. The check uses each
tensor's version counter (bumped by every in-place update: optimizer steps,
``load_state_dict``, ``copy_``) and storage pointer (bumped by ``.to()``), so training
then decoding needs no manual step. Call :meth:`MLA.refresh_absorbed` after changing a
weight in a way PyTorch cannot see (e.g. through ``.data`` of a detached alias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..cache.full import FullKVCache
from ..cache.latent import LatentCache
from ..config import MLAConfig
from ..dtypes import accumulate_dtype, cast
from ..norms import make_qk_norms
from ..ops.linear import linear
from ..ops.mla_decode import mla_decode_with_kvcache, select_backend
from ..ops.mla_decode.torch_impl import latent_scores
from ..rope import RotaryEmbedding
from .functional import check_hidden, default_positions, per_head, record_max_logits, sdpa

PATHS = ("auto", "explicit", "absorbed", "expand")


@dataclass
class AbsorbedWeights:
    """Weights of the absorbed path, derived from ``kv_b_proj`` and the QK-norm weights.

    w_uk: [G, d_n, d_c], W_UK^(g)^T per group (contiguous). It serves both GEMMs of a decode
        step: the query's, q_lat = rho(q^C) · (q^C ⊙ gamma_qk) @ w_uk[g], and the cache
        writer's, every group's content key of a token as c @ w_uk[g].T (one GEMM batched over groups).
        One stored copy serves both (a decode step runs them back to back).
    gamma_qk: [d_n], gamma_q^C ⊙ gamma_k^C: the weight the query's content norm uses in
        the absorbed path, so both weights reach q_lat in that one norm (O(h d_n) work);
        None for plain MLA.
    w_uv: [G, d_v, d_c], the value rows: o = o_lat @ w_uv[g].T.
    gamma_r: [h + 1, d_r], gamma_q^R for each query head, then gamma_k^R: a decode step
        normalizes the query's and the new key's RoPE parts, stacked as they are rotated,
        in one norm (blockwise mode); None for plain MLA.
    """

    w_uk: torch.Tensor
    gamma_qk: Optional[torch.Tensor]
    w_uv: torch.Tensor
    gamma_r: Optional[torch.Tensor] = None


def _per_group(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each head times its group's matrix: x [B, T, h, d_in], w [G, d_in, d_out] (head i
    uses w[i // (h / G)]) -> [B, T, h, d_out].

    One bmm over groups, with every token's heads of a group as its rows. The same as
    einsum("btgnd,gdc->btgnc"), without einsum's per-call planning (about half the
    Python time of a decode step's two products on a small CPU).
    """
    B, T, h, d_in = x.shape
    G = w.shape[0]
    rows = x.reshape(B * T, G, h // G, d_in).transpose(0, 1).reshape(G, B * T * (h // G), d_in)
    y = torch.bmm(rows, w)  # [G, B T h/G, d_out]
    return y.view(G, B * T, h // G, -1).transpose(0, 1).reshape(B, T, h, -1)


class MLA(nn.Module):
    """MLA attention layer with optional QK-norm (config: :class:`~qkmla.config.MLAConfig`).

    Examples:
        >>> import torch
        >>> from qkmla import MLA, MLAConfig, LatentCache
        >>> cfg = MLAConfig()                          # tiny, QK RMSNorm, blockwise
        >>> mla = MLA(cfg).eval()
        >>> x = torch.randn(2, 10, cfg.hidden_size)
        >>> y = mla(x)                                 # explicit path, causal
        >>> cache = LatentCache.from_config(cfg, batch_size=2, capacity=16)
        >>> y_pre = mla(x[:, :9], cache)               # prefill writes the latent cache
        >>> y_dec = mla(x[:, 9:], cache)               # absorbed decode step
        >>> torch.allclose(y_dec, y[:, 9:], atol=1e-5)
        True
    """

    def __init__(self, config: MLAConfig):
        super().__init__()
        if not isinstance(config, MLAConfig):
            raise ValueError(f"config: expected an MLAConfig, got {type(config).__name__}")
        self.config = c = config
        bias = c.attention_bias
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = nn.RMSNorm(c.q_lora_rank, eps=c.latent_norm_eps)
            self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = nn.RMSNorm(c.kv_lora_rank, eps=c.latent_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, c.num_kv_groups * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, c.hidden_size, bias=bias)
        self.q_norm, self.k_norm = make_qk_norms(c.qk_norm, c.qk_nope_head_dim, c.qk_rope_head_dim,
                                                 c.qk_norm_p, c.qk_norm_eps, c.qk_norm_mode)
        self.logit_scale = nn.Parameter(torch.full((c.num_heads,), c.scale)) if c.learnable_logit_scale else None
        self.rotary = RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta, c.rope_interleave, c.rope_scaling)
        self._absorbed: Optional[AbsorbedWeights] = None
        self._absorbed_key: Optional[tuple] = None
        # Set track_max_logits to record each head's max logit of every explicit forward
        # (for QK-Clip and diagnostics), in chunks, with the seconds it took.
        self.track_max_logits = False
        self.last_max_logits: Optional[torch.Tensor] = None
        self.max_logit_seconds = 0.0

    # -- shared pieces ----------------------------------------------------------------------

    @property
    def decode_backend(self) -> str:
        """The decode op's backend, ``config.decode_backend`` (read-only here)."""
        return self.config.decode_backend

    @decode_backend.setter
    def decode_backend(self, value) -> None:
        raise ValueError(f"decode_backend: set it in the config, MLA(config.replace(decode_backend={value!r})), "
                         f"or mla.config = mla.config.replace(decode_backend={value!r})")

    @property
    def scale(self):
        """tau: a float, or the learnable per-head scale [h]."""
        return self.logit_scale if self.logit_scale is not None else self.config.scale

    def _raw_query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q^C [B, T, h, d_n], q~^R [B, T, h, d_r]) before any norm or RoPE."""
        c = self.config
        if c.q_lora_rank is None:
            q = linear(x, self.q_proj)
        else:
            q = linear(self.q_a_layernorm(linear(x, self.q_a_proj)), self.q_b_proj)
        q = q.view(*x.shape[:2], c.num_heads, c.qk_head_dim)
        return q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)

    def _latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c [B, T, d_c] after kv_a_layernorm, k~^R [B, T, 1, d_r] before norm and RoPE)."""
        c = self.config
        c_kv, k_rope = linear(x, self.kv_a_proj_with_mqa).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        return self.kv_a_layernorm(c_kv), k_rope.unsqueeze(2)

    # -- explicit path ----------------------------------------------------------------------

    def explicit_query(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Normalized, rotated q [B, T, h, d_n + d_r]."""
        q_c, q_r = self._raw_query(x)
        if self.q_norm is not None:
            q_c, q_r = self.q_norm(q_c, q_r)
        return torch.cat((q_c, self.rotary(q_r, positions)), dim=-1)

    def explicit_qkv(self, x: torch.Tensor, positions: torch.Tensor, latent=None):
        """Materialized, normalized, rotated q [B, T, h, d_n + d_r], k [B, T, G, d_n + d_r], v [B, T, G, d_v].

        ``latent``: x's (c, k~^R) when the caller already projected them.
        """
        c = self.config
        q = self.explicit_query(x, positions)
        c_kv, k_r = latent if latent is not None else self._latent(x)
        kv = linear(c_kv, self.kv_b_proj).view(*x.shape[:2], c.num_kv_groups, c.qk_nope_head_dim + c.v_head_dim)
        k_c, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        if self.k_norm is not None:
            k_c, k_r = self.k_norm(k_c, k_r)  # unified: k_r picks up each group's scalar
        k_r = self.rotary(k_r, positions).expand(*k_c.shape[:3], c.qk_rope_head_dim)
        return q, torch.cat((k_c, k_r), dim=-1), v

    # -- absorbed path ----------------------------------------------------------------------

    def _absorb_sources(self) -> list[torch.Tensor]:
        """The parameters the absorbed weights derive from, looked up afresh (a parameter
        may be replaced). This runs on every decode step: it reads the modules' own dicts,
        since each ``nn.Module.__getattr__`` level costs about a microsecond."""
        modules = self._modules
        sources = [modules["kv_b_proj"]._parameters["weight"]]
        if self.q_norm is not None:
            for norm in (modules["q_norm"]._modules, modules["k_norm"]._modules):
                sources += [norm["content"]._parameters["weight"], norm["rope"]._parameters["weight"]]
        return sources

    def refresh_absorbed(self) -> AbsorbedWeights:
        """Derive the absorbed weights from the current parameters (no autograd)."""
        c = self.config
        with torch.no_grad():
            w = self.kv_b_proj.weight.detach().view(c.num_kv_groups, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            gamma_qk = gamma_r = None
            if self.q_norm is not None:
                gamma_qk = self.q_norm.content.weight.detach() * self.k_norm.content.weight.detach()
                gamma_r = torch.cat((self.q_norm.rope.weight.detach().expand(c.num_heads, -1),
                                     self.k_norm.rope.weight.detach()[None]))
            self._absorbed = AbsorbedWeights(w[:, :c.qk_nope_head_dim].contiguous(), gamma_qk,
                                             w[:, c.qk_nope_head_dim:].contiguous(), gamma_r)
        self._absorbed_key = tuple((p._version, p.data_ptr(), p.dtype, p.device) for p in self._absorb_sources())
        return self._absorbed

    @property
    def absorbed(self) -> AbsorbedWeights:
        """The absorbed weights, re-derived if a source parameter changed since last use."""
        key = tuple((p._version, p.data_ptr(), p.dtype, p.device) for p in self._absorb_sources())
        if self._absorbed is None or key != self._absorbed_key:
            return self.refresh_absorbed()
        return self._absorbed

    def absorbed_query(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_lat [B, T, h, d_c], q_rope [B, T, h, d_r]), logit scale not yet applied."""
        q_lat, q_r = self._latent_query(*self._raw_query(x), self.absorbed)
        return q_lat, self.rotary(q_r, positions)

    def _latent_query(self, q_c, q_r, absorbed: AbsorbedWeights):
        """(q_lat [B, T, h, d_c], q~^R [B, T, h, d_r] normalized, not yet rotated)."""
        if self.q_norm is not None:
            # Normalized with gamma_q^C ⊙ gamma_k^C in place of gamma_q^C: the query scalar
            # and both weights ride into q_lat through one norm.
            q_c, q_r = self.q_norm(q_c, q_r, content_weight=absorbed.gamma_qk)
        # Each group's heads share one W_UK^(g).
        return _per_group(q_c, absorbed.w_uk), q_r

    def cache_rows(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a :class:`LatentCache` stores for tokens x: ``latent`` [B, T, d_c + d_r] and,
        with a QK norm, ``inv_rms`` [B, T, G].

        The content keys c W_UK of these tokens are formed (one GEMM for all groups), reduced
        to one scalar per group, and discarded.
        """
        return self._cache_rows(*self._latent(x), positions)

    def _cache_rows(self, c_kv, k_r, positions):
        """cache_rows from x's already projected (c, k~^R)."""
        k_r, inv_rms = self._key_scalars(c_kv, k_r, self.absorbed)
        return self._rows(c_kv, self.rotary(k_r, positions), inv_rms)

    def _key_content(self, c_kv: torch.Tensor, absorbed: AbsorbedWeights) -> torch.Tensor:
        """Every group's content key c W_UK^(g): c [B, T, d_c] -> [G, B T, d_n].

        One GEMM batched over groups: at decode (B T = 1) a 4 MB GEMV at the deepseek-v3-tp8
        width, which torch spreads over the CPU's threads by group; cold, it beats both one
        F.linear (MKL's GEMV, one thread) and split_linear over the stacked [G d_n, d_c]
        (`key-gemv*` in benchmarks/results/bench_decode_parts_cpu.json).
        """
        B, T, d_c = c_kv.shape
        G = absorbed.w_uk.shape[0]
        return torch.bmm(c_kv.reshape(1, B * T, d_c).expand(G, B * T, d_c), absorbed.w_uk.transpose(1, 2))

    def _key_scalars(self, c_kv, k_r, absorbed: AbsorbedWeights):
        """(k~^R [B, T, 1, d_r] normalized, not yet rotated; key scalars [B, T, G] or None)."""
        if self.k_norm is None:
            return k_r, None
        B, T, _ = c_kv.shape
        k_c = self._key_content(c_kv, absorbed)
        k_c = k_c.view(k_c.shape[0], B, T, -1).permute(1, 2, 0, 3)  # [B, T, G, d_n]
        if self.k_norm.mode == "blockwise":
            r = self.k_norm.content.statistic(k_c)
            k_r = self.k_norm.rope(k_r)
        else:  # one scalar for [k^C; k^R]; the RoPE key keeps only its weight
            r, _ = self.k_norm.statistics(k_c, k_r)
            k_r = k_r * cast(self.k_norm.rope.weight, k_r.dtype)
        return k_r, r.squeeze(-1)

    def _decode_blockwise(self, q_c, q_r, c_kv, k_r, absorbed: AbsorbedWeights):
        """A decode step's blockwise QK norm of the queries and the new keys, in few ops.

        Args: q^C [B, T, h, d_n], q~^R [B, T, h, d_r], c [B, T, d_c], k~^R [B, T, 1, d_r].

        Returns:
            q_lat [B, T, h, d_c]; [q^R ; k^R] normalized, not yet rotated [B, T, h + 1, d_r];
            the key scalars [B, T, G].

        The same numbers as :meth:`_latent_query` and :meth:`_key_scalars`, arranged for a
        small CPU, where each dispatched op costs more than its arithmetic: the query's content
        rows and the new keys' c W_UK^(g) rows are stacked, so one moment and one statistic
        serve both (q_norm and k_norm share kind, p and eps: one config builds both), and the
        query's and the key's RoPE rows are normalized together with stacked weights.
        """
        B, T, h, d_n = q_c.shape
        G = absorbed.w_uk.shape[0]
        rows = torch.cat((q_c.reshape(B * T * h, d_n), self._key_content(c_kv, absorbed).view(G * B * T, d_n)))
        sigma = self.k_norm.content.statistic(rows)  # [B T h + G B T, 1]
        q_c = self.q_norm.content.scaled(rows[:B * T * h].view(B, T, h, d_n), sigma[:B * T * h].view(B, T, h, 1),
                                         absorbed.gamma_qk)
        inv_rms = sigma[B * T * h:].view(G, B, T).permute(1, 2, 0)
        qk_r = torch.cat((q_r, k_r), dim=2)
        qk_r = self.k_norm.rope.scaled(qk_r, self.k_norm.rope.statistic(qk_r), absorbed.gamma_r)
        return _per_group(q_c, absorbed.w_uk), qk_r, inv_rms

    @staticmethod
    def _rows(c_kv, k_rope, inv_rms) -> dict[str, torch.Tensor]:
        """Cache rows from c [B, T, d_c], the rotated k^R [B, T, 1, d_r] and the scalars."""
        rows = {"latent": torch.cat((c_kv, k_rope.squeeze(2)), dim=-1)}
        if inv_rms is not None:
            rows["inv_rms"] = inv_rms
        return rows

    def _values_out(self, o_lat: torch.Tensor, absorbed: AbsorbedWeights) -> torch.Tensor:
        """o = o_lat W_UV^(g) per head, then o_proj. [B, T, h, d_c] -> [B, T, hidden]."""
        o = _per_group(o_lat, cast(absorbed.w_uv, o_lat.dtype).transpose(1, 2))  # [B, T, h, d_v]
        return linear(o.flatten(2), self.o_proj)

    # -- logits (the Appendix E test) --------------------------------------------------------

    def logits(self, x: torch.Tensor, path: str = "explicit", positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal pre-softmax logits [B, h, T, T] of one sequence chunk (masked entries -inf).

        ``path="explicit"`` dots materialized normalized keys; ``path="absorbed"`` writes the
        chunk's cache rows and uses latent dot products scaled by the scalars.
        """
        check_hidden(x, self.config.hidden_size, self.o_proj.weight.dtype)
        positions = default_positions(x, positions)
        T = x.shape[1]
        if path == "explicit":
            q, k, _ = self.explicit_qkv(x, positions)
            k = k.repeat_interleave(self.config.heads_per_group, dim=2)
            acc = accumulate_dtype(q.dtype)
            s = torch.einsum("bthd,bshd->bths", q, k).to(acc) * per_head(self.scale, 1)
        elif path == "absorbed":
            q_lat, q_rope = self.absorbed_query(x, positions)
            rows = self.cache_rows(x, positions)
            s = latent_scores(q_lat, q_rope, rows["latent"], rows.get("inv_rms"), self.config.qk_norm_mode)
            s = s * per_head(self.scale, 1)
        else:
            raise ValueError(f"path: expected 'explicit' or 'absorbed', got {path!r}")
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        return s.masked_fill(~causal[:, None, :], float("-inf")).transpose(1, 2)

    # -- forward ---------------------------------------------------------------------------

    def _check_cache(self, cache) -> None:
        c = self.config
        if isinstance(cache, LatentCache):
            want_groups = c.num_kv_groups if c.qk_norm is not None else 0
            got = (cache.kv_lora_rank, cache.qk_rope_head_dim, cache.num_kv_groups)
            if got != (c.kv_lora_rank, c.qk_rope_head_dim, want_groups):
                raise ValueError(
                    f"cache: LatentCache(kv_lora_rank, qk_rope_head_dim, num_kv_groups)={got} does not match this "
                    f"layer, which needs {(c.kv_lora_rank, c.qk_rope_head_dim, want_groups)}; "
                    f"build it with LatentCache.from_config(config, ...)")
        elif isinstance(cache, FullKVCache):
            cache.check_shape(c.num_kv_groups, c.qk_head_dim, c.v_head_dim)
        elif cache is not None:
            raise ValueError(f"cache: expected a LatentCache, a FullKVCache or None, got {type(cache).__name__}")

    def forward(self, x: torch.Tensor, cache=None, *, positions: Optional[torch.Tensor] = None,
                input_lengths: Optional[torch.Tensor] = None, path: str = "auto") -> torch.Tensor:
        """Attend over x (and the cache), writing x's tokens into the cache.

        Args:
            x: [B, T, hidden_size] in the module's dtype.
            cache: None (causal attention within x), a :class:`LatentCache` or a :class:`FullKVCache`.
            positions: [B, T] or [T]. Without a cache, defaults to 0..T-1; with one, it may be
                passed only to assert where the tokens go (each sequence's cached length on).
            input_lengths: [B], with a cache: only the first input_lengths[b] tokens of
                sequence b are real (right padding); their outputs are meaningful, the rest are not.
            path: "auto" (explicit without a cache or for a prefill into an empty latent cache,
                absorbed otherwise), "explicit", "absorbed" or "expand" (re-expand cached keys).

        Returns:
            [B, T, hidden_size]
        """
        check_hidden(x, self.config.hidden_size, self.o_proj.weight.dtype)
        if path not in PATHS:
            raise ValueError(f"path: expected one of {PATHS}, got {path!r}")
        self._check_cache(cache)
        if cache is None:
            if path not in ("auto", "explicit"):
                raise ValueError(f"path: {path!r} reads a latent cache; pass cache=LatentCache(...) or use 'explicit'")
            if input_lengths is not None:
                raise ValueError("input_lengths: only meaningful with a cache (padding is not written)")
            q, k, v = self.explicit_qkv(x, default_positions(x, positions))
            if self.track_max_logits:
                record_max_logits(self, q, k)
            o = sdpa(q, k, v, self.scale, causal=True)
            return linear(o.flatten(2), self.o_proj)

        slot = cache.plan(x.shape[0], x.shape[1], positions, input_lengths)
        if isinstance(cache, FullKVCache):
            if path not in ("auto", "explicit"):
                raise ValueError("path: a FullKVCache holds materialized keys, so only 'auto'/'explicit' apply, "
                                 f"got {path!r}")
            q, k, v = self.explicit_qkv(x, slot.positions)
            k, v = cache.update(slot, k, v)
            o = sdpa(q, k, v, self.scale, mask=slot.key_mask())
            return linear(o.flatten(2), self.o_proj)

        if path == "auto":
            path = "explicit" if cache.max_len == 0 and x.shape[1] > 1 else "absorbed"
        if path == "explicit":
            if cache.max_len != 0:
                raise ValueError("path: 'explicit' with a latent cache is only a prefill into an empty cache; "
                                 "use 'absorbed' or 'expand' to attend over cached tokens")
            latent = self._latent(x)  # projected once: for the cache rows and the explicit keys
            cache.append(slot, **self._cache_rows(*latent, slot.positions))
            q, k, v = self.explicit_qkv(x, slot.positions, latent)
            return linear(sdpa(q, k, v, self.scale, causal=True).flatten(2), self.o_proj)

        if path == "expand":
            cache.append(slot, **self.cache_rows(x, slot.positions))
            k, v = self.expand_cache(cache.read("latent"), cache.read("inv_rms") if "inv_rms" in cache.fields else None)
            q = self.explicit_query(x, slot.positions)
            return linear(sdpa(q, k, v, self.scale, mask=slot.key_mask()).flatten(2), self.o_proj)
        # Both large projections first, then the two products with W_UK back to back (the new
        # keys' GEMV, then the query's GEMM, which finds part of the weights in cache), then
        # the query and key RoPE heads rotated together in one call (blockwise: normalized
        # together too, each row with its own weight).
        q_c, q_r = self._raw_query(x)
        c_kv, k_r = self._latent(x)
        c = self.config
        absorbed = self.absorbed  # looked up once per step: the staleness check is not free
        joint = self.k_norm is not None and self.k_norm.mode == "blockwise"
        if joint:
            q_lat, qk_r, inv_rms = self._decode_blockwise(q_c, q_r, c_kv, k_r, absorbed)
        else:
            q_lat, q_r = self._latent_query(q_c, q_r, absorbed)
            k_r, inv_rms = self._key_scalars(c_kv, k_r, absorbed)
            qk_r = torch.cat((q_r, k_r), dim=2)  # [B, T, h + 1, d_r]
        q_rope, k_rope = self.rotary(qk_r, slot.positions).split([q_c.shape[2], 1], dim=2)
        # Settled before the cache is written: a backend that cannot run must not leave the
        # new token in the cache (a retry would attend to it twice).
        backend = select_backend(c.decode_backend, x.device, c.kv_lora_rank, c.qk_rope_head_dim)
        with cache.transaction():  # and anything that fails later takes the token out again
            cache.append(slot, **self._rows(c_kv, k_rope, inv_rms))
            o_lat = self._decode_attention(q_lat, q_rope, cache, slot, backend)
        return self._values_out(o_lat, absorbed)

    def _decode_attention(self, q_lat, q_rope, cache: LatentCache, slot, backend: str) -> torch.Tensor:
        """The decode op over the cache: q_lat [B, T, h, d_c], q_rope [B, T, h, d_r] -> o_lat [B, T, h, d_c]."""
        scale = self.scale
        if isinstance(scale, torch.Tensor):  # per-head scales ride on the queries
            head_scale = per_head(scale, 1).to(q_lat.dtype)
            q_lat, q_rope, scale = q_lat * head_scale, q_rope * head_scale, 1.0
        # A padded batch: each query sees the slots up to its own (the padding's are unused).
        visible = slot.positions + 1 if slot.valid is not None else None
        mode = self.config.qk_norm_mode if self.k_norm is not None else "blockwise"
        out, _ = mla_decode_with_kvcache(q_lat, q_rope, **cache.decode_view(), softmax_scale=float(scale),
                                         backend=backend, mode=mode, visible_lens=visible)
        return out

    def expand_cache(self, latent: torch.Tensor, inv_rms: Optional[torch.Tensor]):
        """HF-style: up-project every cached latent [B, S, d_c + d_r] to normalized keys
        [B, S, G, d_n + d_r] and values [B, S, G, d_v] (the work the absorbed path avoids)."""
        c = self.config
        dtype = self.kv_b_proj.weight.dtype
        c_kv, k_r = latent.to(dtype).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = linear(c_kv, self.kv_b_proj).view(*c_kv.shape[:2], c.num_kv_groups, c.qk_nope_head_dim + c.v_head_dim)
        k_c, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_r = k_r.unsqueeze(2).expand(*k_c.shape[:3], c.qk_rope_head_dim)
        if self.k_norm is not None:
            r = inv_rms.to(dtype).unsqueeze(-1)  # [B, S, G, 1]: the cached scalars
            k_c = k_c * self.k_norm.content.weight.to(dtype) * r
            if self.k_norm.mode == "unified":
                k_r = k_r * r
        return torch.cat((k_c, k_r), dim=-1), v
