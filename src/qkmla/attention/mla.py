"""Multi-head Latent Attention with post-up-projection QK normalization.

One module, three ways to attend (MATH.md names throughout):

* **explicit** (training, prefill): materialize q and k, normalize them, one
  ``scaled_dot_product_attention`` call. Parameter names are DeepSeek's/HF's
  (``q_a_proj``, ``kv_b_proj``, ...), so an HF state dict loads as is.
* **absorbed** (decode): the query moves into latent space with both norm weights folded
  in, each new token is reduced to its cache row (latent, RoPE key, G key scalars), the
  row is appended to a :class:`LatentCache`, the decode op (``qkmla.ops.mla_decode``)
  attends over the cache, and W_UV and ``o_proj`` finish. The math is in ``absorbed.py``.
  A cache with an eviction policy may then drop tokens (``LatentCache.after_attention``).
* **expand** (the HF-style baseline): read the latent cache and re-expand every key with
  W_UK at every step.

Absorbed weights are derived from ``kv_b_proj`` and the norm weights on first use, kept, and
re-derived whenever one of those parameters changes, any ``torch.optim`` optimizer steps
(fused AdamW changes weights without bumping their version counters), the module switches
between ``train()`` and ``eval()``, or ``kv_b_proj`` or a norm module is swapped
(``absorbed.DerivedWeights``). So training then decoding needs no manual step. Call
:meth:`MLA.refresh_absorbed` after changing a weight in a way PyTorch cannot see (through
``.data``, or an update outside ``torch.optim``'s step).
"""

from __future__ import annotations

import contextlib

from dataclasses import replace
from typing import Optional

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.prune import BasePruningMethod

from ..cache.full import FullKVCache
from ..cache.latent import LatentCache
from ..config import MLAConfig, fixed_config
from ..norms import LatentRMSNorm, qk_norms_of
from ..ops.mla_decode import mla_decode_with_kvcache, resolve_backend
from ..rope import RotaryEmbedding
from ..utils.limits import check_weights
from .absorbed import (AbsorbedWeights, DerivedWeights, absorb, expand_keys, key_scalars, latent_query, score_mode,
                       values_out)
from .functional import (TracksMaxLogits, default_positions, no_decode_gradient, no_gradient_through,
                         record_max_logits, sdpa, zero_padding)
from .logits import causal_logits
from .paths import PATHS, resolve_path  # noqa: F401  (PATHS: still importable from here)
from .selection import selection_mask
from .sinks import apply_sinks


def uncached_positions(x: torch.Tensor, positions: Optional[torch.Tensor],
                       rope_positions: Optional[torch.Tensor]) -> torch.Tensor:
    """[B, T] RoPE positions of a forward without a cache, where ``positions`` are the RoPE positions:
    rope_positions, the caller's own numbering (signed, as a host model's), were ignored there, and the tokens
    rotated to 0..T-1 (0.2 off the reference) without a word. Both at once: refused, naming rope_positions."""
    if rope_positions is None:
        return default_positions(x, positions)
    if positions is not None:
        raise ValueError("rope_positions: without a cache, positions are the RoPE positions; pass one of them")
    return default_positions(x, rope_positions, "rope_positions", signed=True)


def projection_shapes(c: MLAConfig) -> dict[str, tuple[int, ...]]:
    """The weight shape of every projection and latent norm of an MLA layer, by (HF's) name."""
    shapes = {"q_proj": (c.num_heads * c.qk_head_dim, c.hidden_size)} if c.q_lora_rank is None else {
        "q_a_proj": (c.q_lora_rank, c.hidden_size), "q_a_layernorm": (c.q_lora_rank,),
        "q_b_proj": (c.num_heads * c.qk_head_dim, c.q_lora_rank)}
    return {**shapes, "kv_a_proj_with_mqa": (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size),
            "kv_a_layernorm": (c.kv_lora_rank,),
            "kv_b_proj": (c.num_kv_groups * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
            "o_proj": (c.hidden_size, c.num_heads * c.v_head_dim)}


_BIASED = ("q_a_proj", "kv_a_proj_with_mqa", "o_proj")  # the projections attention_bias gives a bias


def new_projections(c: MLAConfig) -> dict[str, nn.Module]:
    """Freshly initialized projections and latent norms for ``c``."""
    modules = {}
    for name, shape in projection_shapes(c).items():
        if name.endswith("layernorm"):
            modules[name] = LatentRMSNorm(shape[0], eps=c.latent_norm_eps)
        else:
            modules[name] = nn.Linear(shape[1], shape[0], bias=c.attention_bias and name in _BIASED)
    return modules


def check_projections(c: MLAConfig, modules: dict[str, nn.Module],
                      wanted: Optional[dict[str, tuple[int, ...]]] = None) -> dict[str, nn.Module]:
    """``modules`` if it holds every projection ``c`` needs (``wanted``: their shapes by name, by default
    :func:`projection_shapes`) with the right weight shapes and biases."""
    wanted = projection_shapes(c) if wanted is None else wanted
    missing = sorted(set(wanted) - set(modules))
    if missing:
        raise ValueError(f"projections: missing {missing}; this config needs {sorted(wanted)}")
    for name, shape in wanted.items():
        weight = getattr(modules[name], "weight", None)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != shape:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
            raise ValueError(f"projections: {name}.weight has shape {got}, this config needs {shape}")
        has_bias = getattr(modules[name], "bias", None) is not None
        if not name.endswith("layernorm") and has_bias != (c.attention_bias and name in _BIASED):
            raise ValueError(f"projections: {name} {'has' if has_bias else 'lacks'} a bias, but the config says "
                             f"attention_bias={c.attention_bias}")
    return {name: modules[name] for name in wanted}


class MLA(TracksMaxLogits):
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

    config = fixed_config(mutable=("decode_backend",))

    def __init__(self, config: MLAConfig, projections: Optional[dict[str, nn.Module]] = None):
        """``projections``: existing modules to use as the projections and latent norms, by
        name (another library's layer, adopted without a copy); their weights must have the
        shapes ``config`` gives (:func:`projection_shapes`). By default new ones are made."""
        super().__init__()
        if not isinstance(config, MLAConfig):
            raise ValueError(f"config: expected an MLAConfig, got {type(config).__name__}")
        self.config = c = config
        if projections is None:  # a config every check accepts may still ask for more memory than there is
            check_weights("config", self.projection_shapes(c).values(),
                          f"the projections of an MLA layer with hidden_size={c.hidden_size}, num_heads={c.num_heads}, "
                          f"q_lora_rank={c.q_lora_rank}, kv_lora_rank={c.kv_lora_rank}")
        modules = new_projections(c) if projections is None else check_projections(c, projections,
                                                                                    self.projection_shapes(c))
        for name, module in modules.items():
            setattr(self, name, module)
        self.q_norm, self.k_norm = qk_norms_of(c)
        self.logit_scale = nn.Parameter(torch.full((c.num_heads,), c.scale)) if c.learnable_logit_scale else None
        # Attention sinks [h] (config.attention_sinks; sinks.py): none, and no parameter, in plain MLA
        self.sinks = nn.Parameter(torch.zeros(c.num_heads)) if c.attention_sinks else None
        self.rotary = RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta, c.rope_interleave, c.rope_scaling)
        self._absorbed = DerivedWeights()
        # Set track_max_logits to record each head's max logit of every explicit forward
        # (for QK-Clip and diagnostics), in chunks, with the seconds it took.
        self.track_max_logits = False
        self.last_max_logits: Optional[torch.Tensor] = None
        self.max_logit_seconds = 0.0

    def projection_shapes(self, c: MLAConfig) -> dict[str, tuple[int, ...]]:
        """The projections this layer adopts, by name, with their weight shapes (:func:`projection_shapes`;
        a subclass whose query is projected otherwise names its own, read by its own ``raw_query``)."""
        return projection_shapes(c)

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

    # -- projections ------------------------------------------------------------------------

    def query_latent(self, x: torch.Tensor) -> torch.Tensor:
        """c^Q [B, T, q_lora_rank]: the query's low-rank latent after ``q_a_layernorm`` (with a
        query LoRA; DeepSeek's indexer reads it too)."""
        return self.q_a_layernorm(self.q_a_proj(x))

    def raw_query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q^C [B, T, h, d_n], q~^R [B, T, h, d_r]) before any norm or RoPE."""
        c = self.config
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.query_latent(x))
        q = q.view(*x.shape[:2], c.num_heads, c.qk_head_dim)
        return q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(c [B, T, d_c] after kv_a_layernorm, k~^R [B, T, 1, d_r] before norm and RoPE)."""
        c = self.config
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        return self.kv_a_layernorm(c_kv), k_rope.unsqueeze(2)

    def padded_latent(self, x: torch.Tensor, valid: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`latent` with the right padding's rows (``valid`` [B, T] False) set to 0 after kv_a_layernorm.
        x's padding is zero already, but the norm of a zero vector is NaN at latent_norm_eps=0, and a padded
        key's NaN reached the real tokens through their softmax's 0 weights (0 * NaN)."""
        c_kv, k_r = self.latent(x)
        if valid is None:
            return c_kv, k_r
        return c_kv.masked_fill(~valid[..., None], 0), k_r.masked_fill(~valid[..., None, None], 0)

    # -- explicit path ----------------------------------------------------------------------

    def explicit_query(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Normalized, rotated q [B, T, h, d_n + d_r]."""
        q_c, q_r = self.raw_query(x)
        if self.q_norm is not None:
            q_c, q_r = self.q_norm(q_c, q_r)
        return torch.cat((q_c, self.rotary(q_r, positions)), dim=-1)

    def explicit_qkv(self, x: torch.Tensor, positions: torch.Tensor, latent=None):
        """Materialized, normalized, rotated q [B, T, h, d_n + d_r], k [B, T, G, d_n + d_r], v [B, T, G, d_v].

        ``latent``: x's (c, k~^R) when the caller already projected them.
        """
        c = self.config
        q = self.explicit_query(x, positions)
        c_kv, k_r = latent if latent is not None else self.latent(x)
        kv = self.kv_b_proj(c_kv).view(*x.shape[:2], c.num_kv_groups, c.qk_nope_head_dim + c.v_head_dim)
        k_c, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        if self.k_norm is not None:
            k_c, k_r = self.k_norm(k_c, k_r)  # unified, content: k_r picks up each group's scalar
        k_r = self.rotary(k_r, positions).expand(*k_c.shape[:3], c.qk_rope_head_dim)
        return q, torch.cat((k_c, k_r), dim=-1), v

    # -- absorbed path (the math: absorbed.py) -----------------------------------------------

    def _absorb_sources(self) -> list[torch.Tensor]:
        """Every parameter the absorbed path reads through the absorbed weights or the norms."""
        # First, for every path to the absorbed weights: an adapter may have wrapped kv_b_proj since they were
        # kept, and a wrapper may have no .weight to read (refresh_absorbed() failed here with AttributeError).
        self._check_kv_b_proj()
        sources = [self.kv_b_proj.weight]
        pruning = [h for h in self.kv_b_proj._forward_pre_hooks.values() if isinstance(h, BasePruningMethod)]
        for hook in pruning:
            # recomputes .weight from weight_orig and the mask, as kv_b_proj's own forward would: the absorbed path
            # never runs that forward, and read the weight of before the last update (1.03 off). The kept weights
            # follow weight_orig and the mask: the recomputed .weight is a new tensor each time, which may reuse a
            # freed one's address and version (a stale hit)
            hook(self.kv_b_proj, ())
            sources = [getattr(self.kv_b_proj, hook._tensor_name + suffix) for suffix in ("_orig", "_mask")]
        if parametrize.is_parametrized(self.kv_b_proj, "weight"):
            # Under torch.nn.utils.parametrize (weight_norm, orthogonal, a user's), .weight is recomputed at each read:
            # a new tensor of version 0, whose address may be a freed one's, so an update of the originals was not
            # seen and the absorbed path decoded with the weight of before it (0.36 to 3.6 off the explicit path).
            # The kept weights follow what .weight is computed from: the originals and the parametrizations' state.
            chain = self.kv_b_proj.parametrizations["weight"]
            sources = [*chain.parameters(), *chain.buffers()]
        if self.q_norm is not None:
            sources += [norm.weight for qk in (self.q_norm, self.k_norm) for norm in (qk.content, qk.rope)]
        return sources

    def _check_kv_b_proj(self) -> None:
        kind = type(self.kv_b_proj)
        # An nn.Linear whose forward is nn.Linear's: its output is x @ weight.T (+ bias). A subclass with a forward
        # of its own (loralib's Linear, bitsandbytes' Linear8bitLt) passed an isinstance check, and the absorbed
        # path read its .weight alone: 1.42 off the explicit path, without a word.
        if isinstance(self.kv_b_proj, nn.Linear) and kind.forward is nn.Linear.forward:
            # Its output is x @ weight.T only without a bias and without hooks that change its input or output:
            # a bias or a forward hook (nn.Linear(..., bias=True) assigned in its place, a hook scaling its output)
            # moved the absorbed path 0.4 to 2.0 off the explicit one without a word. A pruning method's pre-hook
            # only recomputes .weight, which the absorbed path reads.
            if self.kv_b_proj.bias is not None:
                raise ValueError("kv_b_proj: has a bias, which the absorbed path (reading kv_b_proj.weight alone) "
                                 "cannot fold into the query and the output; MLA's kv_b_proj has none "
                                 "(attention_bias biases q_a_proj, kv_a_proj_with_mqa and o_proj)")
            hooks = [h for h in self.kv_b_proj._forward_pre_hooks.values() if not isinstance(h, BasePruningMethod)]
            if hooks or self.kv_b_proj._forward_hooks:
                raise ValueError("kv_b_proj: has forward hooks, which the absorbed path (reading kv_b_proj.weight "
                                 "outside its forward) would skip; remove them, or run a forward that needs no "
                                 "cache without one (transformers: use_cache=False)")
            return
        if not isinstance(self.kv_b_proj, nn.Module):  # None, or a tensor set in its place
            raise ValueError(f"kv_b_proj: expected an nn.Linear (the latent's up-projection), got {kind.__name__}")
        # Read by any cached forward, a prefill too: a LoRA model's plain eval forward (transformers caches by
        # default) was refused with merging as the only way, which ends the adapter's training; and PEFT's
        # class, named "Linear", read as "this kv_b_proj is a Linear, whose output is not x @ weight.T".
        raise ValueError(f"kv_b_proj: the absorbed path reads kv_b_proj.weight, but this kv_b_proj is a "
                         f"{kind.__module__}.{kind.__qualname__}, whose output is not "
                         f"x @ weight.T; merge its adapters into the weight first "
                         f"(qkmla.integrations.transformers.merge_lora(model), PEFT's merge_and_unload()), or run "
                         f"a forward that needs no cache without one (transformers: use_cache=False)")

    def _derive(self) -> AbsorbedWeights:
        c = self.config
        self._check_kv_b_proj()
        # Derived outside inference mode even when first needed inside it (generate under
        # torch.inference_mode()), so a later training step can still use them.
        with torch.inference_mode(False):
            return absorb(self.kv_b_proj.weight, self.q_norm, self.k_norm, c.num_kv_groups, c.qk_nope_head_dim)

    def refresh_absorbed(self) -> AbsorbedWeights:
        """Derive the absorbed weights from the current parameters (no autograd)."""
        return self._absorbed.get(self._absorb_sources(), self._derive, force=True)

    @property
    def absorbed(self) -> AbsorbedWeights:
        """The absorbed weights, kept and re-derived when a source parameter changed since last
        use or any ``torch.optim`` optimizer stepped (fused AdamW changes weights without bumping
        their version counters)."""
        return self._absorbed.get(self._absorb_sources(), self._derive)

    def step_weights(self) -> AbsorbedWeights:
        """The absorbed weights a forward computes with: the kept ones (:attr:`absorbed`), or, where autograd
        records through the parameters they come from (a decode step trained through, a path that expands the
        cached keys), weights derived afresh with autograd and not kept, so that backward reaches kv_b_proj and
        the norm weights (the kept ones, derived without it, left them out of the gradient). Within one
        absorbed decode step, the weights it derived once (:meth:`_absorbed_decode`)."""
        held = self.__dict__.get("_step_weights")
        if held is not None:
            return held
        if self.records_weight_gradients():
            c = self.config
            return absorb(self.kv_b_proj.weight, self.q_norm, self.k_norm, c.num_kv_groups, c.qk_nope_head_dim,
                          track=True)
        return self.absorbed

    def records_weight_gradients(self) -> bool:
        """Whether autograd records through the parameters the absorbed weights come from (so a forward must
        derive them afresh, with autograd, rather than read the kept ones)."""
        return torch.is_grad_enabled() and any(p.requires_grad for p in self._absorb_sources())

    def __setattr__(self, name: str, value) -> None:
        # A module the absorbed weights are derived from, swapped (an adapter wrapping kv_b_proj,
        # or merged back into it through .data): what was kept no longer describes it.
        if name in ("kv_b_proj", "q_norm", "k_norm") and "_absorbed" in self.__dict__:
            self.__dict__["_absorbed"] = DerivedWeights()
        super().__setattr__(name, value)

    def train(self, mode: bool = True) -> "MLA":
        """``nn.Module.train``; the kept absorbed weights are dropped at every switch, so a model
        trained (however its optimizer updates the weights) decodes with weights derived after."""
        self._absorbed = DerivedWeights()
        return super().train(mode)

    def absorbed_query(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_lat [B, T, h, d_c], q_rope [B, T, h, d_r]), logit scale not yet applied."""
        q_lat, q_r = latent_query(*self.raw_query(x), self.q_norm, self.step_weights())
        return q_lat, self.rotary(q_r, positions)

    def cache_rows(self, x: torch.Tensor, positions: torch.Tensor, latent=None, cache=None) -> dict[str, torch.Tensor]:
        """What :meth:`LatentCache.append` takes for tokens x: ``c_kv`` [B, T, d_c], the normalized,
        rotated ``k_rope`` [B, T, d_r] and ``key_scale`` [B, T, G] (None without a QK norm).
        ``latent``: x's (c, k~^R) if already projected. ``cache``: the cache the rows go to; r
        is computed from c as it reads c back (``stored_latent``: dequantized, if quantized)."""
        c_kv, k_r = latent if latent is not None else self.latent(x)
        c_read = cache.stored_latent(c_kv) if cache is not None else c_kv
        # without a key norm the rows need no absorbed weight: a prefill into an empty cache (where the transformers
        # integration marks the kept weights stale) does not derive them for nothing
        weights = self.step_weights() if self.k_norm is not None else None
        k_r, key_scale = key_scalars(c_read, k_r, self.k_norm, weights)
        return {"c_kv": c_kv, "k_rope": self.rotary(k_r, positions).squeeze(2), "key_scale": key_scale}

    def logits(self, x: torch.Tensor, path: str = "explicit", positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal pre-softmax logits [B, h, T, T] (masked entries -inf), ``path`` "explicit" or
        "absorbed": the Appendix E test (:func:`.logits.causal_logits`)."""
        return causal_logits(self, x, path, positions)

    # -- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, cache=None, *, positions: Optional[torch.Tensor] = None,
                input_lengths: Optional[torch.Tensor] = None, path: str = "auto",
                indices: Optional[torch.Tensor] = None,
                rope_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attend over x (and the cache), writing x's tokens into the cache.

        Args:
            x: [B, T, hidden_size] in the module's dtype.
            cache: None (causal attention within x), a :class:`LatentCache` or a :class:`FullKVCache`.
            positions: [B, T], [1, T] or [T]. Without a cache, defaults to 0..T-1; with one, it may be
                passed only to assert where the tokens go (each sequence's cached length on).
            input_lengths: [B], with a cache: only the first input_lengths[b] tokens of
                sequence b are real (right padding); their outputs are meaningful, the rest are not.
            path: "auto" (explicit without a cache or for a prefill into an empty latent cache,
                absorbed otherwise; :func:`.paths.cheaper_cached_path` compares absorbed and
                expand for a call), "explicit", "absorbed" or "expand" (re-expand cached keys).
            indices: [B, T, topk] int, with a latent cache: a sparse (top-k) attention's selection,
                the cache slots (after this write) each new token attends to, -1 for none; the
                caller's selection is the whole visibility rule (it must be causal). Every path
                honours it: the absorbed decode reads only those rows and their key scalars (the
                op's ``indices``), the explicit prefill and "expand" mask the other keys. Those two
                equal the absorbed path for a selection of distinct slots within each sequence's
                length; a slot listed twice counts twice only on the absorbed path.
            rope_positions: [B, T] or [T] integers: the RoPE positions of the new tokens where the
                caller numbers them its own way (a host model's ``position_ids``; the cache's
                numbering otherwise). The queries and the cached RoPE keys are rotated to them; the
                slots the rows go to are the cache's as always. Attention then depends on the
                caller's position differences, as the caller's own attention's does. Without a cache
                they are what ``positions`` is there (pass one or the other).

        Returns:
            [B, T, hidden_size]
        """
        path = resolve_path(self, x, cache, path, input_lengths, indices)
        if cache is None:
            q, k, v = self.explicit_qkv(x, uncached_positions(x, positions, rope_positions))
            if self.track_max_logits:
                record_max_logits(self, q, k)
            return self.project_out(sdpa(q, k, v, self.scale, causal=True, sinks=self.sinks), x)
        slot = cache.plan(x.shape[0], x.shape[1], positions, input_lengths, writer=self)
        if rope_positions is not None:
            slot = replace(slot, positions=default_positions(x, rope_positions, "rope_positions", signed=True)
                           .to(slot.positions.device))
        x = zero_padding(x, slot.valid)  # on every path: padding never reaches a real token
        if isinstance(cache, FullKVCache):
            q, k, v = self.explicit_qkv(x, slot.positions)
            k, v = cache.update(slot, k, v)
            return self.project_out(sdpa(q, k, v, self.scale, mask=slot.key_mask(), sinks=self.sinks), x)
        with cache.transaction():  # a failure after the write takes x's tokens out again
            out, queries = self._attend_latent(x, cache, slot, path, indices)
            # The cache's eviction policy, if it has one, may drop tokens now; it reads
            # queries() only if it ranks tokens by attention.
            cache.after_attention(self, slot, queries)
        return self.project_out(out, x)

    def project_out(self, heads: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [B, T, h, d_v] of tokens x [B, T, hidden] to [B, T, hidden]: ``o_proj``
        (x is read by a subclass whose heads are gated by their input, as Ling's are)."""
        return self.o_proj(heads.flatten(2))

    def _attend_latent(self, x: torch.Tensor, cache: LatentCache, slot, path: str,
                       indices: Optional[torch.Tensor] = None):
        """Write x's rows into the latent cache and attend along ``path`` (to the slots ``indices``
        selects, if given). Returns the heads' outputs [B, T, h, d_v] and a function giving x's
        latent queries (q_lat, q_rope)."""
        if path in ("explicit", "expand"):
            latent = self.padded_latent(x, slot.valid)  # projected once: for the cache rows and the explicit keys
            cache.append(slot, **self.cache_rows(x, slot.positions, latent, cache))
            if path == "explicit":  # a prefill into an empty latent cache
                q, k, v = self.explicit_qkv(x, slot.positions, latent)
                mask = selection_mask(indices, x.shape[1]) if indices is not None else None
                out = sdpa(q, k, v, self.scale, mask=mask, causal=mask is None, sinks=self.sinks)
            else:
                k, v = self.expand_cache(*cache.load())
                mask = slot.key_mask()
                if indices is not None:
                    mask = selection_mask(indices, k.shape[1])
                out = sdpa(self.explicit_query(x, slot.positions), k, v, self.scale, mask=mask, sinks=self.sinks)
                out = no_gradient_through(out, cache)  # the cached rows: bytes, in a quantized format
            return out, lambda: self.absorbed_query(x, slot.positions)
        # In eval mode a decode step is inference, also outside torch.no_grad (a plain `model(ids,
        # use_cache=True)` loop): the kept weights and the op's fast paths, no graph kept in the cache,
        # and a backward that says so (no_decode_gradient) rather than the gradient of part of the step.
        inference = not self.training and torch.is_grad_enabled()
        with torch.no_grad() if inference else contextlib.nullcontext():
            out, queries = self._absorbed_decode(x, cache, slot, indices)
        if inference:
            out = no_decode_gradient(out, x, self)
        elif torch.is_grad_enabled() and cache.eviction is not None:
            # the policy moves rows without autograd (evictor.py), which would credit a slot's gradient to
            # the token first written there: a later step's gradient would be wrong, silently
            out = no_decode_gradient(out, x, self, reason="evicting")
        return no_gradient_through(out, cache), queries

    def _absorbed_decode(self, x: torch.Tensor, cache: LatentCache, slot, indices: Optional[torch.Tensor]):
        """:meth:`_attend_latent`'s absorbed path, its weights derived once for the step (held for
        :meth:`step_weights`, so that the query, the key scalars and the values share them)."""
        w = self.__dict__["_step_weights"] = self.step_weights()
        try:
            return self._absorbed_decode_with(w, x, cache, slot, indices)
        finally:
            self.__dict__.pop("_step_weights", None)

    def _absorbed_decode_with(self, w: AbsorbedWeights, x: torch.Tensor, cache: LatentCache, slot,
                              indices: Optional[torch.Tensor]):
        q_lat, q_rope = self.absorbed_query(x, slot.positions)
        rows = self.cache_rows(x, slot.positions, self.padded_latent(x, slot.valid), cache=cache)
        # The backend is settled once, from the cache's own tensors and row format and the rows
        # about to be written (their autograd becomes the cache's), before the cache is written:
        # one that cannot run must not leave the new token in the cache (a retry would attend to
        # it twice); the op then runs it as named.
        view = cache.decode_view()
        backend = resolve_backend(self.config.decode_backend, q_lat, q_rope, view["kv_cache"], view["scale_cache"],
                                  self.scale, view["kv_format"], written=rows)
        cache.append(slot, **rows)
        visible = slot.visible_lens() if indices is None else None  # the selection is the whole rule
        o_lat, lse = mla_decode_with_kvcache(q_lat, q_rope, **cache.decode_view(), softmax_scale=self.scale,
                                             backend=backend, mode=self.score_mode, visible_lens=visible,
                                             indices=indices)
        if self.sinks is not None:  # W_UV is linear: the latent output takes the sinks' share (sinks.py)
            o_lat = apply_sinks(o_lat, lse, self.sinks)
        return values_out(o_lat, w), lambda: (q_lat, q_rope)

    @property
    def score_mode(self) -> str:
        """How the key scalar enters a logit (the decode op's ``mode``): :func:`absorbed.score_mode`."""
        return score_mode(self.k_norm)

    def expand_cache(self, latent: torch.Tensor, key_scale: Optional[torch.Tensor]):
        """HF-style: every cached latent [B, S, d_c + d_r] up-projected to normalized keys
        [B, S, G, d_n + d_r] and values [B, S, G, d_v] (see :func:`absorbed.expand_keys`)."""
        if torch.is_grad_enabled():  # autograd saves them for the backward, and the next append writes them in place
            latent = latent.clone()
            key_scale = key_scale.clone() if key_scale is not None else None
        return expand_keys(latent, key_scale, self.kv_b_proj, self.k_norm, self.config)
