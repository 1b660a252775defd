"""A transformers MLA attention layer (DeepSeek-V2/V3's and the families of ``families``) served by
qkmla's :class:`~qkmla.MLA`.

:class:`LatentAttention` is an :class:`~qkmla.MLA` that takes transformers' attention call
(``hidden_states``, ``attention_mask``, ``position_embeddings``, the cache under any of the
names transformers versions use) and adopts the HF layer's own projection modules, so its
``state_dict()`` keys are transformers' own and nothing is copied. What it computes is MLA's:

    no cache      the explicit path (training, scoring a batch), positions and padding as
                  transformers gives them, and packed sequences (several in a batch row,
                  padding-free training) each attending within itself
    a cache       the cache layer's :class:`~qkmla.LatentCache`: an explicit prefill into an
                  empty cache, the absorbed decode op otherwise (``MLA.forward``)

transformers passes the attention layer a mask already expanded for its own attention
functions (4-D, or None, or a flex ``BlockMask``), which says nothing the latent cache can
use; the 2-D padding mask the caller gave the model is what it needs. The model-level hook of
``apply_latent_attention`` reads it and passes each call's new real tokens down as a
:class:`LatentCall`, with transformers' own keyword arguments; where the call packs several
sequences into a row (``position_ids`` restarting and no mask, or ``cu_seq_lens_q/k``), the call
says which sequence each token belongs to, and SDPA gets a block-diagonal causal mask.

Padding is never cached. Each sequence's real tokens are moved to the front of the batch row
(left padding becomes right padding), cached with ``input_lengths``, with their RoPE keys rotated
to the ``position_ids`` transformers passes (whatever it passes: generate's numbering of a
left-padded batch, the column numbers of a right-padded one, a caller's own), so attention sees
the position differences transformers' own attention sees; their outputs are moved back, and a
padding position gets what transformers' attention gives it: attention over the real tokens before
it, or zeros where there are none (its logits are read: a right-padded generate picks its first new
token from the last column's). So a prompt batched with longer ones gives the tokens it gives
alone.

Fewer KV groups than heads (a converted GQA model, ``qkmla.convert.gqa``): transformers' layer
has one ``kv_b_proj`` group per head, so such a model stores each group's rows repeated for its
heads. The layer keeps one copy per group (and caches G key scalars per token); its state dict
repeats them again, so ``save_pretrained`` writes transformers' shapes, and loading a state dict
takes either form (repeats checked).

A family whose attention differs from DeepSeek-V3's (``families.HostAttention``, one value per
layer) gets its differences where they enter: the query and latent scales in ``raw_query`` and
``latent`` (every path reads them there), the position-dependent query scale in
``explicit_query`` / ``absorbed_query``, the output gate in ``project_out``, and NoPE as a rotary
that turns nothing (:class:`~qkmla.integrations.transformers.rope.NoRotary`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from ...attention.functional import sdpa
from ...attention.mla import MLA
from ...config import MLAConfig, QKNormConfig
from ...cache.eviction import EvictionPolicy
from ...rope import ROPE_TYPES, check_position_range, position_range
from ...utils.checked import as_number, is_number
from ..hub.config import hf_rope_type, unrepeat_groups
from .cache import adopt_layer
from .families import HostAttention
from .rope import NoRotary, TransformersRotary
from .static import StaticLatentCacheLayer, static_attend
from .view import AttentionReference
from .weights import cached_weights, explicit_weights


@dataclass
class LatentSettings:
    """Shared by a patched model's attention layers: how the caches the model makes for itself
    store (``kv_format``) and evict (``policy``) tokens. ``apply_latent_attention`` sets them."""

    kv_format: str = "dense"
    policy: Optional[EvictionPolicy] = None


@dataclass
class LatentCall:
    """What one forward call of the model tells its attention layers, passed down the call with
    transformers' own keyword arguments (``qkmla_call=``), so gradient checkpointing's recompute,
    a nested call and another thread each see their own.

    valid: [B, T] bool, True for the real tokens among the call's T new ones (from the caller's
        2-D ``attention_mask``), or None when every token is real.
    documents: [B, T] int, which of the sequences packed into its row each token belongs to
        (transformers' padding-free convention, read by ``apply_latent_attention``'s hook from
        restarting ``position_ids`` or ``cu_seq_lens_q/k``), or None when each row is one sequence.
        A token attends to the tokens of its own sequence only; such a call is never cached.
    attentions: None, or (``output_attentions=True``) a dict each layer puts its attention weights
        in, [B, h, T, K] by ``layer_idx`` (:mod:`~qkmla.integrations.transformers.weights`).
    visible: [B, T, K] bool, a custom mask (transformers' 4-D ``attention_mask``, read by the hook):
        which of the K columns (the cached ones, then the call's) each new token sees; every column
        is a token then, none is padding. None: causal over the real tokens.
    """

    valid: Optional[torch.Tensor] = None
    documents: Optional[torch.Tensor] = None
    attentions: Optional[dict] = None
    visible: Optional[torch.Tensor] = None


class LatentAttention(MLA):
    """transformers' MLA attention (``DeepseekV3Attention`` and its families'), computed by qkmla.

    Args:
        config: the layer's :class:`~qkmla.MLAConfig` (``qkmla.integrations.hub.config.mla_config_from_hf``).
        layer_idx: the layer's cache index, as transformers numbers cache layers.
        projections: the HF layer's projection and latent-norm modules by name, adopted as they are.
        settings: the model's shared :class:`LatentSettings`.
        host: how the family's attention differs from DeepSeek-V3's (``families.HostAttention``;
            None: it does not).
        g_proj: the HF layer's output-gate projection, adopted under transformers' name for it
            (``host.gate_name``: Ling's ``g_proj``, HY-V4's ``gate_proj``), where ``host.output_gate`` says.
    """

    def __init__(self, config: MLAConfig, layer_idx: int, projections: Optional[dict] = None,
                 settings: Optional[LatentSettings] = None, host: Optional[HostAttention] = None,
                 g_proj: Optional[torch.nn.Module] = None):
        host = host if host is not None else HostAttention(rope="interleaved" if config.rope_interleave else "halves")
        # read by projection_shapes while MLA adopts the projections (AXK2's fused query), before Module's setup
        object.__setattr__(self, "_fused_query", host.output_gate == "query")
        super().__init__(config, projections)
        self.layer_idx = layer_idx
        self.settings = settings if settings is not None else LatentSettings()
        self.host = host
        gated = self.host.output_gate is not None
        if gated != (g_proj is not None):
            raise ValueError(f"g_proj: the family's attention {'gates' if gated else 'does not gate'} its heads' "
                             f"outputs, so g_proj must be {'its gate projection' if gated else 'None'}")
        if gated:  # under transformers' name, so the state dict's keys are its own
            setattr(self, self.host.gate_name, g_proj)
        if self.host.attention_sinks != config.attention_sinks:
            raise ValueError(f"config: the family's attention {'has' if self.host.attention_sinks else 'has no'} "
                             f"attention sinks, so config.attention_sinks must be {self.host.attention_sinks}")
        if self.host.rope == "none":
            self.rotary = NoRotary()
        self.is_causal = True  # read by some transformers utilities
        self.attention_dropout = 0.0  # from_hf: the HF layer's, applied to the probabilities in training (_uncached)
        self.hf_cache_layout = "expanded"  # from_hf: what transformers' own attention caches (view.py)
        self.hf_rope_halves = False  # from_hf: whether it caches RoPE keys as halves (view.py)
        if config.num_kv_groups < config.num_heads:  # state dicts in transformers' shapes (module docstring)
            self.register_state_dict_post_hook(_repeat_kv_b_proj)
            self.register_load_state_dict_pre_hook(_unrepeat_kv_b_proj)

    @classmethod
    def from_hf(cls, hf_attention, settings: Optional[LatentSettings] = None, hf_rotary=None,
                host: Optional[HostAttention] = None, **overrides) -> "LatentAttention":
        """The qkmla layer for an HF MLA attention layer (``DeepseekV3Attention``, a family's), sharing its weights.

        ``hf_rotary``: the model's own rotary embedding (``model.model.rotary_emb``), used for a
        ``rope_type`` qkmla's :class:`~qkmla.rope.RotaryEmbedding` does not compute ("linear",
        "dynamic", ...; :class:`~qkmla.integrations.transformers.rope.TransformersRotary`); None
        refuses those. ``host``: the family's :class:`~.families.HostAttention` (None: DeepSeek's,
        as its config says). ``overrides``: :class:`~qkmla.MLAConfig` fields (``decode_backend``, or a QK norm).
        """
        from ..hub.config import hf_projections, mla_config_from_hf

        if host is not None:  # a family's: its RoPE layout and softmax scale, whatever DeepSeek's config reading says
            overrides.setdefault("rope_interleave", host.rope != "halves")
            overrides["any_model_type"] = True
            overrides["attention_sinks"] = host.attention_sinks
            if host.rope == "none" or not host.yarn_scale:
                overrides.update(rope_scaling=None, any_rope_type=True)
        overrides.setdefault("any_rope_type", hf_rotary is not None)
        config = mla_config_from_hf(hf_attention.config, **overrides)
        hf_scale = getattr(hf_attention, "scaling", None)
        # A family's layer states its own softmax scale, which the config alone does not always give:
        # transformers 5.4's Mistral 4 leaves YaRN's mscale out, 5.24's applies it. The layer's own wins.
        # (DeepSeek-V2's before 5.16 leaves it out too, where qkmla applies it, as DeepSeek's own code does.)
        if host is not None and isinstance(hf_scale, float) and not config.learnable_logit_scale \
                and abs(config.scale - hf_scale) > 1e-9 * hf_scale \
                and not getattr(hf_attention.config, "model_type", "").endswith("deepseek_v2"):
            config = config.replace(softmax_scale=hf_scale)
        # the sinks are adopted as they are (transformers keeps them in float32 in a bfloat16 model)
        sinks = hf_attention.sinks if host is not None and host.attention_sinks else None
        params = [p for name, p in hf_attention.named_parameters() if name != "sinks" or sinks is None]
        # On the meta device (transformers' from_pretrained builds the model there, then loads the
        # weights into the modules this layer adopts): nothing is read from the weights here,
        # except for fewer KV groups than heads, whose kv_b_proj is reshaped.
        if any(p.is_meta for p in params) and config.num_kv_groups < config.num_heads:
            raise ValueError("hf_attention: its weights are on the meta device (offloaded, or not loaded yet) and "
                             "its kv_b_proj holds fewer KV groups than heads, which is reshaped from the weights; "
                             "load the model's weights onto a real device first")
        kinds = sorted({f"{p.device}/{p.dtype}" for p in params})
        if len(kinds) != 1 or not params[0].dtype.is_floating_point or params[0].dtype.itemsize < 2:
            raise ValueError(f"hf_attention: its parameters must share one device and a floating dtype of 2 bytes or "
                             f"more, got {kinds} (FP8 weights: load them dequantized, e.g. dtype=torch.bfloat16)")
        projections = hf_projections(hf_attention)
        if config.num_kv_groups < config.num_heads:  # one copy of each group's rows (module docstring)
            repeated = projections["kv_b_proj"].weight
            weight = unrepeat_groups(repeated.detach(), config, "hf_attention: kv_b_proj.weight")
            kv_b_proj = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            kv_b_proj.weight = torch.nn.Parameter(weight, requires_grad=repeated.requires_grad)
            projections["kv_b_proj"] = kv_b_proj
        g_proj = getattr(hf_attention, host.gate_name) if host is not None and host.output_gate is not None else None
        layer = cls(config, getattr(hf_attention, "layer_idx", 0), projections, settings, host, g_proj)
        layer.attention_dropout = check_attention_dropout(getattr(hf_attention, "attention_dropout", 0.0))
        # what transformers' own attention caches, for a cache's keys/values view (view.py)
        layer.hf_cache_layout = "latent" if hasattr(type(hf_attention), "expand_kv") else "expanded"
        # DeepSeek-V3's rotates interleaved pairs by first moving them to halves, and caches them so
        layer.hf_rope_halves = type(hf_attention).__name__.startswith("DeepseekV3")
        if hf_rotary is not None and layer.host.rope != "none" and hf_rope_type(hf_attention.config) not in ROPE_TYPES:
            layer.rotary = TransformersRotary(hf_rotary, config.rope_interleave)
        layer = layer.to(device=params[0].device, dtype=params[0].dtype).train(hf_attention.training)
        if sinks is not None:
            layer.sinks = sinks
        return layer

    @property
    def gate(self) -> Optional[torch.nn.Module]:
        """The output-gate projection (``host.gate_name``), or None."""
        return getattr(self, self.host.gate_name, None) if self.host.output_gate is not None else None

    def check_no_dropout(self, what: str, way_out: str = "call with use_cache=False, or model.eval()") -> None:
        """A ValueError naming attention_dropout for a training call through ``what`` (a path other than the
        explicit one without a cache, the one that applies the host's attention dropout: ``_uncached``)."""
        if self.training and self.attention_dropout:
            raise ValueError(f"attention_dropout: this model's attention drops {self.attention_dropout} of its "
                             f"weights in training, which qkmla applies on the explicit path without a cache only; "
                             f"this training call goes through {what}: {way_out}")

    def with_norm(self, norm: QKNormConfig) -> "LatentAttention":
        """This layer with the QK norm ``norm`` added, sharing its projection modules; the norm
        weights start at ones."""
        from ..hub.config import hf_projections

        weight = self.kv_b_proj.weight
        layer = type(self)(self.config.replace(qk_norm=norm), self.layer_idx, hf_projections(self), self.settings,
                           self.host, self.gate)
        layer.rotary, layer.hf_cache_layout, layer.hf_rope_halves = self.rotary, self.hf_cache_layout, self.hf_rope_halves
        layer.attention_dropout = self.attention_dropout
        layer = layer.to(device=weight.device, dtype=weight.dtype).train(self.training)
        if self.sinks is not None:  # the same parameter, in its own dtype
            layer.sinks = self.sinks
        return layer

    # -- the family's differences from DeepSeek-V3 (families.HostAttention) ----------------------

    def projection_shapes(self, c: MLAConfig) -> dict[str, tuple[int, ...]]:
        """MLA's projections; with AXK2's fused query (``host.output_gate`` "query") ``q_gate_proj``
        [h (d_n + d_r + d_v), 2 d_cq] in place of ``q_b_proj``."""
        shapes = super().projection_shapes(c)
        if self._fused_query:
            del shapes["q_b_proj"]
            shapes["q_gate_proj"] = (c.num_heads * (c.qk_head_dim + c.v_head_dim), 2 * c.q_lora_rank)
        return shapes

    def _fused_query_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """AXK2's fused projection: (q [B, T, h, d_n + d_r], gate logits [B, T, h, d_v]) from
        q_gate_proj([q_a_layernorm(q_a_proj(x)), q_a_proj(x)])."""
        c = self.config
        compressed = self.q_a_proj(x)
        fused = self.q_gate_proj(torch.cat((self.q_a_layernorm(compressed), compressed), dim=-1))
        return fused.view(*x.shape[:2], c.num_heads, c.qk_head_dim + c.v_head_dim).split(
            [c.qk_head_dim, c.v_head_dim], dim=-1)

    def raw_query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's (q^C [B, T, h, d_n], q~^R [B, T, h, d_r]) (AXK2's: from its fused projection), times the
        family's query scale."""
        if self._fused_query:
            q_c, q_r = self._fused_query_gate(x)[0].split([self.config.qk_nope_head_dim,
                                                           self.config.qk_rope_head_dim], dim=-1)
        else:
            q_c, q_r = super().raw_query(x)
        s = self.host.query_scale
        return (q_c, q_r) if s == 1.0 else (q_c * s, q_r * s)

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MLA's (c [B, T, d_c], k~^R [B, T, 1, d_r]), c times the family's latent scale."""
        c_kv, k_r = super().latent(x)
        s = self.host.latent_scale
        return (c_kv, k_r) if s == 1.0 else (c_kv * s, k_r)

    def temperature(self, positions: torch.Tensor) -> Optional[torch.Tensor]:
        """Mistral 4's query scale at ``positions`` [B, T] or [T]: [..., T, 1, 1], or None (no such scale)."""
        if self.host.position_temperature is None:
            return None
        beta, length = self.host.position_temperature
        scale = 1 + beta * torch.log1p(torch.floor(positions.double() / length))
        return scale[..., None, None]

    def explicit_query(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q = super().explicit_query(x, positions)
        scale = self.temperature(positions)
        return q if scale is None else q * scale.to(q.dtype)

    def absorbed_query(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_lat, q_rope = super().absorbed_query(x, positions)
        scale = self.temperature(positions)
        return (q_lat, q_rope) if scale is None else (q_lat * scale.to(q_lat.dtype), q_rope * scale.to(q_rope.dtype))

    def project_out(self, heads: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``o_proj`` of the heads' outputs [B, T, h, d_v], gated first where the family gates them
        (``host.output_gate``), as transformers computes the gate: Ling's per head, sigmoid(g_proj(x))
        [B, T, h] in float32; HY-V4's per channel, sigmoid(gate_proj(x)) [B, T, h, d_v] in x's dtype; AXK2's
        per channel, sigmoid of the gate columns of its fused query projection, in float32."""
        gate = self.gate
        if gate is not None and self.host.output_gate == "head":
            heads = heads * torch.sigmoid(gate(x).float()).to(heads.dtype)[..., None]
        elif gate is not None and self.host.output_gate == "query":  # the fused projection again, for its gate rows
            heads = (heads * torch.sigmoid(self._fused_query_gate(x)[1].float())).to(heads.dtype)
        elif gate is not None:
            heads = heads * torch.sigmoid(gate(x).view(heads.shape)).to(heads.dtype)
        return self.o_proj(heads.flatten(2))

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_embeddings=None, **kwargs):
        """transformers' attention call: ``hidden_states`` [B, T, hidden_size] -> (output [B, T, hidden_size], None).

        ``attention_mask`` and ``position_embeddings`` are transformers' own and are not read
        (see the module docstring); which tokens are padding comes as ``qkmla_call`` (a
        :class:`LatentCall`; absent: none are); the cache as ``cache``, ``past_key_values`` or
        ``past_key_value``, whichever this transformers version uses.
        """
        if self.sinks is not None:  # the weights, static-cache and custom-mask paths here compute without them
            raise ValueError("sinks: a dense MLA layer with attention sinks is not served by LatentAttention; the "
                             "families with sinks (HY-V4) are sparse attention, SparseLatentAttention")
        cache = next((kwargs[k] for k in ("cache", "past_key_values", "past_key_value") if kwargs.get(k) is not None),
                     None)
        x = hidden_states
        if cache is None or not getattr(self.settings.policy, "reposition", False):  # a repositioning cache reads none
            check_host_position_ids(kwargs.get("position_ids"), x.dtype)
        call = kwargs.get("qkmla_call") or LatentCall()
        valid = call.valid.to(x.device) if call.valid is not None else None
        documents = call.documents.to(x.device) if call.documents is not None else None
        want = call.attentions is not None
        visible = call.visible.to(x.device) if call.visible is not None else None
        if cache is None:
            out, weights = self._uncached(x, valid, kwargs.get("position_ids"), documents, want, visible)
            if want:
                call.attentions[self.layer_idx] = weights
            return out, weights
        if documents is not None:
            raise ValueError("cache: this call packs several sequences into a batch row, which a cache (one "
                             "sequence per row) cannot hold; call without a cache")
        self.check_no_dropout("a cache")
        layer = adopt_layer(cache, self.layer_idx, self.config, self.settings.kv_format, self.settings.policy)
        if layer.attention is None:  # its keys and values are this layer's up-projections (view.py)
            layer.attention = AttentionReference(self)
        if isinstance(layer, StaticLatentCacheLayer):  # fixed shapes for torch.compile (static.py)
            if self.host.position_temperature is not None:
                raise ValueError("cache_implementation: this family's position-dependent query scale "
                                 "(llama_4_scaling_beta) is not applied over a static latent cache; use the growing "
                                 "cache (the default)")
            out, weights = static_attend(self, layer, x, valid, kwargs.get("position_ids"), want)
            if want:
                call.attentions[self.layer_idx] = weights
            return out, weights
        positions = rope_positions(kwargs.get("position_ids"), self.settings.policy, x.shape[0], x.shape[1])
        latent = layer.reserve(x.shape[0], x.shape[1], x.device, x.dtype, self.config)
        if visible is not None:
            out, weights = self._custom_masked(x, visible, layer, latent, positions, want)
            if want:
                call.attentions[self.layer_idx] = weights
            return out, weights
        if valid is None:
            out = MLA.forward(self, x, latent, rope_positions=positions)
        else:
            out = self._compacted(x, valid, latent, positions)
        layer.advance(valid, x.shape[0], x.shape[1])
        if not want:
            return out, None
        weights = cached_weights(self, x, layer, positions)
        call.attentions[self.layer_idx] = weights
        return out, weights

    def _uncached(self, x: torch.Tensor, valid: Optional[torch.Tensor], position_ids,
                  documents: Optional[torch.Tensor] = None, weights: bool = False,
                  visible: Optional[torch.Tensor] = None):
        """The explicit path over x alone, at transformers' positions, padding masked, and each
        packed sequence (``documents`` [B, T]) attending within itself: a block-diagonal causal mask;
        or a caller's own mask (``visible`` [B, T, T] bool, transformers' 4-D mask) as it is.
        Returns (output [B, T, hidden], the attention weights [B, h, T, T] if ``weights``, else None).

            documents  0 0 0 1 1        query t sees key s when s <= t and documents[s] == documents[t]
                       x . . . .
                       x x . . .
                       x x x . .
                       . . . x .
                       . . . x x
        """
        B, T = x.shape[:2]
        positions = (position_ids if position_ids is not None else torch.arange(T, device=x.device)).expand(B, T)
        q, k, v = self.explicit_qkv(x, positions.to(x.device))
        mask = visible
        if visible is None and (valid is not None or documents is not None):
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril().expand(B, T, T)
            if documents is not None:
                mask = mask & (documents[:, :, None] == documents[:, None, :])
            if valid is not None:  # padding keys hidden. A padding query sees the real tokens before it, as
                # transformers' attention's does, and one with none gives 0 (sdpa's empty row), as transformers'
                # sdpa and the cached path give it: it saw itself too, and a right-padded generate(use_cache=False),
                # which picks its first new token from the last column's logits, a padding one, chose other tokens
                mask = mask & valid[:, None, :]
        dropout = self.attention_dropout if self.training else 0.0
        if not weights and not dropout:
            return self.project_out(sdpa(q, k, v, self.scale, mask=mask, causal=mask is None), x), None
        # Asked for the weights: the output is computed from them, as transformers' eager attention
        # does, so gradients reach them (a caller may retain_grad on them). So is a training call with
        # the host's attention_dropout, dropped from them as transformers' attention drops them.
        probs = explicit_weights(q, k, self.scale, mask)
        if valid is not None:  # padding keys: 0, as transformers' are; a padding query's row is the one the sdpa
            # path above attends with (zeroed, its output was 0 here and another there)
            probs = probs * valid[:, None, None, :].to(probs.dtype)
        if dropout:  # never applied before: a config's attention_dropout trained without it, without a word
            probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
        h, G = q.shape[2], v.shape[2]
        heads_v = v.repeat_interleave(h // G, dim=2) if G != h else v
        out = torch.einsum("bhts,bshd->bthd", probs, heads_v)
        return self.project_out(out, x), probs

    def _compacted(self, x: torch.Tensor, valid: torch.Tensor, latent,
                   positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``MLA.forward`` over each sequence's real tokens moved to the front (right padding),
        each at its RoPE position (``positions`` [B, T], moved with it; None: the cache's numbering)."""
        order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # [B, T]: real tokens first, in order
        index = order[..., None].expand_as(x)
        compacted = positions.to(order.device).gather(1, order) if positions is not None else None
        out = MLA.forward(self, x.gather(1, index), latent, input_lengths=valid.sum(dim=1), rope_positions=compacted)
        out = torch.empty_like(out).scatter_(1, index, out).masked_fill(~valid[..., None], 0.0)
        padding = self._padding_queries(x, valid, latent, positions)
        if padding is None:
            return out
        heads, queried = padding
        return torch.where(queried[..., None], self.project_out(heads.to(x.dtype), x), out)

    def _custom_masked(self, x: torch.Tensor, visible: torch.Tensor, layer, latent,
                       positions: Optional[torch.Tensor], weights: bool = False):
        """A call with a caller's own mask (transformers' 4-D ``attention_mask`` as ``visible``
        [B, T, K] over the K columns, cached ones first): the call's T tokens are all cached (at
        ``positions``, transformers' position ids), then each attends to the columns its mask row
        shows, explicitly over the cache's re-expanded keys (a shared prefix with branches, a tree
        of drafts: any pattern). Columns that were padding hold no token and are never seen.
        Returns (output [B, T, hidden], weights [B, h, T, K] if ``weights``, else None)."""
        B, T = x.shape[:2]
        positions = positions if positions is not None else latent.next_positions[:, None] + torch.arange(
            T, device=latent.device)
        positions = positions.to(x.device).expand(B, T)
        slot = replace(latent.plan(B, T, writer=self), positions=positions.to(latent.device))
        latent.append(slot, **self.cache_rows(x, positions, cache=latent))
        layer.advance(None, B, T)
        k, v = self.expand_cache(*latent.load())  # [B, S, G, d_n + d_r], [B, S, G, d_v]
        S, K = k.shape[1], layer.stored.shape[1]
        stored = layer.stored.to(x.device)
        columns = torch.argsort((~stored).to(torch.int8), dim=1, stable=True)[:, :S]  # [B, S]: slot s's column
        filled = torch.arange(S, device=x.device)[None] < stored.sum(dim=1, keepdim=True)  # [B, S]
        seen = visible.gather(2, columns[:, None, :].expand(B, T, S)) & filled[:, None, :]  # [B, T, S]
        q = self.explicit_query(x, positions)
        probs = explicit_weights(q, k, self.scale, seen)  # [B, h, T, S]
        h, G = q.shape[2], v.shape[2]
        heads_v = v.repeat_interleave(h // G, dim=2) if G != h else v
        out = self.project_out(torch.einsum("bhts,bshd->bthd", probs, heads_v.to(probs.dtype)), x)
        if not weights:
            return out, None
        laid_out = probs.new_zeros(B, h, T, K)
        return out, laid_out.scatter_(3, columns[:, None, None, :].expand(B, h, T, S), probs)

    def _padding_queries(self, x: torch.Tensor, valid: torch.Tensor, latent, positions: Optional[torch.Tensor]):
        """What transformers' attention gives the call's padding tokens as queries, which nothing
        reads but the logits at their columns (a right-padded ``generate`` picks its first new token
        from the last column's, a padding one): a padding query at its own position attends to
        the real tokens before it, cached and new (its own key is padding). Only for the queries
        that have one (none: 0, as the cached path gives every padding token). Returns (heads'
        outputs [B, T, h, d_v], which queries they are for [B, T] bool), or None when no padding
        token has a real token before it (left padding into an empty cache), when the positions
        are not transformers' (``positions`` None), or when an eviction policy may have dropped
        some of the cache's tokens.

        Computed explicitly over the cache's re-expanded keys (``expand_cache``), after this
        call's real tokens went in, which costs a whole prefill's keys once per call with such
        padding: decode steps (no padding) never pay it."""
        if positions is None or self.settings.policy is not None:
            return None
        cached = latent.seqlens.to(valid.device) - valid.sum(dim=1)  # [B]: real tokens before this call
        before = cached[:, None] + valid.long().cumsum(dim=1)  # [B, T]: real tokens up to each column
        queried = ~valid & (before > 0)
        if not bool(queried.any()):
            return None
        k, v = self.expand_cache(*latent.load())  # [B, S, G, d_n + d_r], [B, S, G, d_v]
        q = self.explicit_query(x, positions.to(x.device))  # [B, T, h, d_n + d_r]
        visible = torch.arange(k.shape[1], device=x.device)[None, None, :] < before[:, :, None]  # [B, T, S]
        probs = explicit_weights(q, k, self.scale, visible)  # [B, h, T, S]
        h, G = q.shape[2], v.shape[2]
        heads_v = v.repeat_interleave(h // G, dim=2) if G != h else v
        return torch.einsum("bhts,bshd->bthd", probs, heads_v.to(probs.dtype)), queried


def check_attention_dropout(p) -> float:
    """The HF layer's ``attention_dropout`` as a float (None: 0, as transformers' eval calls read it), or a
    ValueError naming it: a probability in [0, 1)."""
    if p is None:
        return 0.0
    p = as_number(p)  # a NumPy scalar (np.float32(0.1)), which eager's dropout takes as it is
    if not is_number(p) or not 0 <= p < 1:
        raise ValueError(f"attention_dropout: expected a probability in [0, 1) (the model config's), got {p!r}")
    return float(p)


def check_host_position_ids(position_ids: Optional[torch.Tensor], dtype: torch.dtype) -> None:
    """transformers' ``position_ids`` that the RoPE angles of ``dtype`` (x's) cannot hold exactly (past 2**24 in
    float32) refused naming ``position_ids``, where reading them is free (the CPU): qkmla's layers below refuse
    them too, but naming their own arguments (positions, rope_positions), which the user never passed."""
    if isinstance(position_ids, torch.Tensor) and position_ids.device.type == "cpu" and position_ids.numel() \
            and not position_ids.dtype.is_floating_point and not torch.compiler.is_compiling():
        check_position_range("position_ids", *position_range(position_ids), dtype)


def rope_positions(position_ids: Optional[torch.Tensor], policy: Optional[EvictionPolicy], batch_size: int,
                   num_tokens: int) -> Optional[torch.Tensor]:
    """The RoPE positions [B, T] the call's tokens are cached at: transformers' ``position_ids``
    as given ([B, T] or [1, T]), or None (the cache numbers each sequence's real tokens 0, 1, 2,
    ...) when none are given or the eviction policy renumbers the cache (StreamingLLM's
    ``reposition=True``: kept keys are turned to positions 0..k-1, and a host that keeps counting
    would put new tokens past them)."""
    if position_ids is None or getattr(policy, "reposition", False):
        return None
    return position_ids.expand(batch_size, num_tokens)


def repeat_groups(weight: torch.Tensor, config: MLAConfig) -> torch.Tensor:
    """kv_b_proj.weight [G (d_n + d_v), d_c] with each group's rows repeated for its heads: [h (d_n + d_v), d_c]."""
    rows = config.qk_nope_head_dim + config.v_head_dim
    per_group = weight.view(config.num_kv_groups, rows, -1)
    return per_group.repeat_interleave(config.heads_per_group, dim=0).reshape(config.num_heads * rows, -1)


def _repeat_kv_b_proj(module: "LatentAttention", state_dict, prefix: str, local_metadata) -> None:
    key = prefix + "kv_b_proj.weight"
    if key in state_dict:
        state_dict[key] = repeat_groups(state_dict[key], module.config)


def _unrepeat_kv_b_proj(module: "LatentAttention", state_dict, prefix: str, local_metadata, strict, missing_keys,
                        unexpected_keys, error_msgs) -> None:
    key, c = prefix + "kv_b_proj.weight", module.config
    if key in state_dict and state_dict[key].shape[0] == c.num_heads * (c.qk_nope_head_dim + c.v_head_dim):
        state_dict[key] = unrepeat_groups(state_dict[key], c, f"state_dict: {key}")
