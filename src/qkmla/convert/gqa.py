"""A QK-normed GQA model (transformers' ``Qwen3ForCausalLM``; ``OlmoeForCausalLM``) converted to a
DeepSeek-V3 (V2 for OLMoE) architecture model with qkmla's QK norm, which decodes through the latent
cache (MATH.md, "Content variant" and "Statistic scope"). The layout below is Qwen3's; OLMoE's differs
in its norm (over the whole projection: ``QKNormConfig(scope="projection")``, a weight row per head, the
key's RoPE weight in kv_a_proj_with_mqa's rows), its MoE layers (DeepSeek-V2's greedy router) and
V2's interleaved RoPE rows.

    model, report = convert_gqa(qwen3)                          # G = 1: exact up to the bound in report
    model, report = convert_gqa(qwen3, kv_lora_rank=256, rope_dim=32, rope_pairs="high")

Per layer, with the source's H query heads, G KV heads of width D, weights W_Q, W_K, W_V, W_O
and its per-head RMSNorm weights gamma_q, gamma_k (before NeoX RoPE, logit scale D^-1/2):

    q_proj              head i: [W_Q^i (D rows: the content block) ; W_Q^i's rows of the kept RoPE pairs (d_r)]
    q_norm              content: gamma_q, zero on the kept pairs' dims; rope: gamma_q on them;
                        both times sqrt((D + d_r) / D), so qkmla's tau = (D + d_r)^-1/2 is the source's D^-1/2
    k_norm              content: gamma_k; rope: gamma_k on the kept pairs' dims
    kv_a_proj_with_mqa  [V_r^T (r rows) ; 0 (the constant channel, bias M) ; the kept pairs' rows of W_K
                        (the mean over the G groups when G > 1)]
    kv_a_layernorm      M / sqrt(r + 1) on the r real channels, 0 on the constant one
    kv_b_proj           group g: [W_K^g ; W_V^g] ≈ U_r S_r, from the SVD [W_K ; W_V] = U S V^T over all groups
                        (the constant channel's column 0), rows repeated per head as transformers stores them
    o_proj              W_O (bias 0)

qk_norm "rms", mode "content": each query's and each group's key statistic is taken over the whole
source head (d_n = D), as the source's is. The kept RoPE pairs move into the RoPE block (DeepSeek's
layout: pairs (k, k + d_r/2)), the others stay in the content block without rotation.

What is exact (to roundoff and the constant-channel bound): the query projection and statistic,
every group's key statistic, the latent when r >= rank [W_K ; W_V], values, and the rotated part when
G = 1 and the RoPE block keeps every pair. What is not: a smaller rank (a truncated SVD), pairs left
out of the RoPE block (they lose their rotation), a RoPE key shared by G > 1 groups (the mean of the
groups' rows), and DeepSeek's kv_a_layernorm, which scales each token's latent by
alpha = (1 + (|u|² + (r+1) eps) / M²)^-1/2: the constant channel M makes 1 - alpha at most ``scale_bound``.

Embeddings, MLP (every layer dense: ``first_k_dense_replace`` = the layer count), norms and the LM head
are the source's tensors. The model's config records ``num_kv_groups`` = G beside the norm, so
``qkmla.integrations.transformers.from_pretrained`` restores G groups (the cache holds G key scalars per token).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import QKNormConfig
from ..utils.files import check_input_file
from .calibrate import check_loaded
from .gqa_fit import LATENTS, ROPE_KEYS, calibration_moments, check_calibration, kv_rank, latent_factors, rope_key_mix
from ..utils.checked import as_int, check_bool, is_int

ROPE_PAIRS = ("uniform", "high")
# The source classes, and what their QK norm's statistic covers (QKNormConfig.scope): Qwen3
# normalizes each head, OLMoE the whole q and k projections (one statistic per token, a weight per channel).
SCOPES = {"Qwen3ForCausalLM": "head", "OlmoeForCausalLM": "projection"}
SOURCES = tuple(SCOPES)
MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM", "olmoe": "OlmoeForCausalLM"}  # config.json's model_type: the class
_POST_NORM = ("normalizes each sublayer's output before the residual add (post-norm), which DeepSeek's "
              "pre-norm layer cannot express")
# Other QK-normed families users ask for, and why each is refused (read from transformers' source).
NOT_CONVERTED = {
    "Olmo2ForCausalLM": "OLMo 2 " + _POST_NORM,
    "Olmo3ForCausalLM": "OLMo 3 " + _POST_NORM,
    "Gemma3ForCausalLM": "Gemma 3 normalizes around each sublayer (sandwich norms), which DeepSeek's layer cannot "
                         "express, and has sliding-window layers",
    "Qwen3MoeForCausalLM": "Qwen3-MoE's MoE layers do not convert yet (its router maps exactly onto DeepSeek-V2's "
                           "only with norm_topk_prob=False)",
}
SCALE_MARGIN = 2.0 ** 20  # M = SCALE_MARGIN x the bound on |u|: 1 - alpha <= 2^-41 (4.5e-13)
FLOAT32_MAX_M = 1e18  # M^2 (and the latent norm's mean of squares) must stay well inside float32


@dataclass
class GQAConversionReport:
    """What :func:`convert_gqa` did and what it left approximate.

    rank: r, the rank of the latent factorization; kv_lora_rank: the latent width cached per token
    (r + 1: the constant channel); max_rank: min(2 G D, hidden_size), the rank that is always exact.
    kept_pairs: the source RoPE pair indices j (frequency theta^(-2j/D)) kept rotated; rope_theta: the
    converted model's theta for them. latent_error[l]: |[W_K ; W_V] - its rank-r part|_F / |[W_K ; W_V]|_F.
    constant[l]: M of layer l; scale_bound: the largest bound on 1 - alpha over the layers.
    """

    num_kv_groups: int
    head_dim: int
    rank: int
    max_rank: int
    kv_lora_rank: int
    rope_dim: int
    rope_pairs: str
    rope_theta: float
    kept_pairs: list[int]
    keep_norm: bool
    scope: str = "head"  # the norm's statistic scope: "head" (G key scalars per token) or "projection" (one)
    rope_key: str = "mean"
    latent: str = "weights"
    # per layer, the fraction of the kept pairs' (normalized) key energy over the calibration tokens that
    # the shared RoPE key's mix holds (1.0: every group's RoPE key is a multiple of it); empty without
    # calibration tokens
    rope_key_energy: list[float] = field(default_factory=list)
    latent_error: list[float] = field(default_factory=list)
    constant: list[float] = field(default_factory=list)
    scale_bound: float = 0.0
    exact: list[str] = field(default_factory=list)
    approximate: list[str] = field(default_factory=list)

    def cache_values_per_token(self) -> tuple[int, int]:
        """(latent + RoPE key values, key scalars) cached per token and layer."""
        if not self.keep_norm:
            return self.kv_lora_rank + self.rope_dim, 0
        return self.kv_lora_rank + self.rope_dim, 1 if self.scope == "projection" else self.num_kv_groups

    def lines(self) -> list[str]:
        values, scalars = self.cache_values_per_token()
        return [f"latent rank {self.rank} of at most {self.max_rank} (kv_lora_rank {self.kv_lora_rank} with the "
                f"constant channel), RoPE {self.rope_dim} dims ({self.rope_pairs} pairs {self.kept_pairs[:4]}"
                f"{' ...' if len(self.kept_pairs) > 4 else ''}, theta {self.rope_theta:g}), {self.num_kv_groups} KV "
                f"groups of {self.head_dim}",
                f"cache per token and layer: {values} values + {scalars} key scalars",
                f"latent factorization error per layer: {', '.join(f'{e:.3g}' for e in self.latent_error)}",
                f"constant channel: 1 - alpha <= {self.scale_bound:.3g}",
                "exact: " + "; ".join(self.exact),
                "approximate: " + ("; ".join(self.approximate) or "nothing")]


def source_attention_shape(model) -> tuple[int, int, int, int]:
    """(hidden_size, H, G, D) of a ``Qwen3ForCausalLM`` or ``OlmoeForCausalLM``, refused (naming ``model``)
    unless the conversion takes it: another class, attention biases, RoPE other than the default, sliding
    windows, OLMoE's QKV clipping or renormalized top-k routing."""
    return config_attention_shape(type(model).__name__, model.config)


def config_attention_shape(name: str, c) -> tuple[int, int, int, int]:
    """:func:`source_attention_shape` of a model of class ``name`` and config ``c``, from the config
    alone: a checkpoint's arguments are checked before its weights are loaded."""
    if name not in SOURCES:
        why = f": {NOT_CONVERTED[name]}" if name in NOT_CONVERTED else ""
        raise ValueError(f"model: expected one of {SOURCES} (a transformers model with a per-head QK norm), got "
                         f"{name}{why}")
    if getattr(c, "attention_bias", False):
        raise ValueError("model: its attention projections have biases (attention_bias=True), which the latent "
                         "factorization does not carry")
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"model: its RoPE is {rope.get('rope_type', rope.get('type'))!r}; only the default RoPE "
                         f"converts (its frequencies must be those of qkmla's rotary embedding)")
    if getattr(c, "use_sliding_window", False) or any(t != "full_attention" for t in getattr(c, "layer_types", None)
                                                     or ()):
        raise ValueError("model: it has sliding-window layers, which MLA's latent cache does not express")
    if getattr(c, "clip_qkv", None) is not None:
        raise ValueError(f"model: it clips q, k and v to +-{c.clip_qkv} (clip_qkv), which the latent factorization "
                         f"does not carry")
    if name == "OlmoeForCausalLM" and c.norm_topk_prob:
        raise ValueError("model: its router renormalizes the top-k probabilities (norm_topk_prob=True), which "
                         "DeepSeek-V2's greedy router does not")
    if name == "OlmoeForCausalLM":  # a hand-edited config.json: converted, and its first forward failed in topk
        experts, k = getattr(c, "num_experts", None), getattr(c, "num_experts_per_tok", None)
        if not (is_int(experts) and experts >= 1 and is_int(k) and 1 <= k <= experts):
            raise ValueError(f"model: its router picks num_experts_per_tok={k!r} of num_experts={experts!r} experts "
                             "per token; expected an int from 1 to num_experts")
    D = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if not isinstance(D, int) or D < 2:  # a hand-edited config.json: --rope-dim, never given, was blamed for it
        raise ValueError(f"model: head_dim {D!r} is not a head's width (an even int >= 2)")
    if D % 2:
        raise ValueError(f"model: head_dim {D} is odd; RoPE rotates pairs")
    H, G = c.num_attention_heads, c.num_key_value_heads
    if not (isinstance(G, int) and G >= 1 and H % G == 0):  # a malformed config.json, not a bug here
        raise ValueError(f"model: num_key_value_heads={G!r} must divide num_attention_heads={H} (each KV head "
                         f"serves a whole group of query heads)")
    return c.hidden_size, H, G, D


def rope_theta_of(config) -> float:
    """The source's RoPE base, refused naming rope_theta unless a finite number > 0 (0 was read as 10000)."""
    from ..integrations.hub.config import rope_theta

    return rope_theta(config)


def resolve_rope(head_dim: int, rope_dim: Optional[int], rope_pairs: Optional[str]) -> tuple[int, str]:
    """(rope_dim, rope_pairs) with their defaults: every pair (head_dim), "uniform". ``rope_pairs`` without
    ``rope_dim`` is refused: every pair is kept then, and the choice was dropped without a word (and
    recorded in the report as made)."""
    if rope_pairs is not None and rope_dim is None:
        raise ValueError("rope_pairs: only read with rope_dim (--rope-dim N: which pairs N dims keep); without it "
                         "every pair is kept: leave it out or give rope_dim")
    return (head_dim if rope_dim is None else rope_dim), ("uniform" if rope_pairs is None else rope_pairs)


def kept_rope_pairs(head_dim: int, rope_dim: int, rope_pairs: str, theta: float) -> tuple[list[int], float]:
    """(the source pairs j kept rotated, theta') so that qkmla's RoPE of width ``rope_dim`` gives pair k
    the source's frequency of pair j_k: theta'^(-2k/rope_dim) = theta^(-2 j_k / head_dim).

    "high": the first rope_dim/2 pairs (the highest frequencies), theta' = theta^(rope_dim/head_dim);
    "uniform": every (head_dim/rope_dim)-th pair from 0, theta' = theta. ValueError naming the argument.
    """
    if rope_pairs not in ROPE_PAIRS:
        raise ValueError(f"rope_pairs: expected one of {ROPE_PAIRS}, got {rope_pairs!r}")
    if not is_int(rope_dim) or rope_dim < 2 or rope_dim > head_dim \
            or rope_dim % 2:
        raise ValueError(f"rope_dim: expected an even int from 2 to head_dim={head_dim}, got {rope_dim!r}")
    m, half = rope_dim // 2, head_dim // 2
    if rope_pairs == "high":
        return list(range(m)), theta ** (rope_dim / head_dim)
    if half % m:
        allowed = [2 * k for k in range(1, half + 1) if half % k == 0]
        raise ValueError(f"rope_dim: {rope_pairs!r} pairs keep every (head_dim/rope_dim)-th pair, so rope_dim must "
                         f"divide head_dim={head_dim} into a whole step (allowed: {allowed}); got {rope_dim}")
    return list(range(0, half, half // m)), theta


FLOAT16_CANNOT = "float16 cannot hold the constant latent channel (its size is far above 65504)"


def _check_rank(kv_lora_rank, max_rank: int) -> None:
    if kv_lora_rank is None:
        return
    if not is_int(kv_lora_rank) or not 1 <= kv_lora_rank <= max_rank:
        raise ValueError(f"kv_lora_rank: expected an int from 1 to min(2 x KV heads x head_dim, hidden_size) = "
                         f"{max_rank} (the rank [W_K ; W_V] can have), got {kv_lora_rank!r}")


def deepseek_config(src, rank: int, rope_dim: int, rope_theta: float):
    """The config of the converted model: no query latent, attention biases (the constant channel), one
    kv_b_proj group per head (transformers' layout). A dense Qwen3 becomes a ``DeepseekV3Config`` with
    every layer dense and the NeoX RoPE layout; OLMoE a ``DeepseekV2Config`` (V2's softmax router is
    OLMoE's: greedy top-k, no renormalization, routed_scaling_factor 1) with every layer MoE, no shared
    expert and V2's interleaved RoPE layout."""
    import transformers

    c = src.config
    _, H, _, D = source_attention_shape(src)
    keep = {k: getattr(c, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "hidden_act", "max_position_embeddings", "rms_norm_eps", "initializer_range",
                                       "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
                                       "attention_dropout", "use_cache") if hasattr(c, k)}
    if "tie_word_embeddings" in keep:  # transformers 5.4 types OLMoE's as an int, DeepSeek's as a bool
        keep["tie_word_embeddings"] = bool(keep["tie_word_embeddings"])
    attention = dict(num_attention_heads=H, num_key_value_heads=H, q_lora_rank=None, kv_lora_rank=rank + 1,
                     qk_nope_head_dim=D, qk_rope_head_dim=rope_dim, v_head_dim=D, attention_bias=True,
                     rope_parameters={"rope_type": "default", "rope_theta": rope_theta})
    if type(src).__name__ == "OlmoeForCausalLM":
        return transformers.DeepseekV2Config(
            **keep, **attention, first_k_dense_replace=0, moe_intermediate_size=c.intermediate_size,
            n_routed_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok, n_shared_experts=0,
            topk_method="greedy", routed_scaling_factor=1.0, n_group=1, topk_group=1,
            # the source's choice of expert kernels (e.g. "eager": grouped_mm takes no float64)
            **({"experts_implementation": c._experts_implementation}
               if getattr(c, "_experts_implementation", None) else {}))
    return transformers.DeepseekV3Config(
        **keep, **attention, rope_interleave=False, first_k_dense_replace=c.num_hidden_layers,
        moe_intermediate_size=c.intermediate_size, n_routed_experts=1, num_experts_per_tok=1, n_shared_experts=1,
        n_group=1, topk_group=1)


def convert_gqa(model, *, kv_lora_rank: Optional[int] = None, rope_dim: Optional[int] = None,
                rope_pairs: Optional[str] = None, keep_norm: bool = True, rope_key: str = "mean",
                latent: str = "weights", calibration: Optional[torch.Tensor] = None):
    """A ``Qwen3ForCausalLM`` as a ``DeepseekV3ForCausalLM``, or an ``OlmoeForCausalLM`` as a
    ``DeepseekV2ForCausalLM``, patched by qkmla (module docstring).

    Args:
        model: the source, a transformers ``Qwen3ForCausalLM`` (dense) or ``OlmoeForCausalLM`` (MoE), not
            modified.
        kv_lora_rank: r, the rank of the latent factorization of [W_K ; W_V], 1 to min(2 G D, hidden_size);
            None: the largest numerical rank over the layers (exact). The cached latent is r + 1 wide.
        rope_dim: d_r, the RoPE dims kept rotated (an even number up to D); None: D (every pair).
        rope_pairs: which pairs: "uniform" (every (D/d_r)-th) or "high" (the first d_r/2, highest frequencies);
            None: "uniform". Only with ``rope_dim`` (refused without it: every pair is kept then).
        keep_norm: True (qkmla's QK RMSNorm, content mode, carrying the source's norm); False drops the norm
            (its statistic and weights, as TransMLA and CARE conversions do: another function).
        rope_key: how G > 1 groups' kept RoPE rows become DeepSeek's one shared RoPE key: "mean" (their
            mean) or "principal" (per kept pair, the mix that best fits every group's key over
            ``calibration``'s tokens: MATH.md, "Content variant"). Both are exact for G = 1.
        latent: what the rank-r factorization is best for: "weights" (the SVD of [W_K ; W_V], any input
            alike) or "activations" (weighted by the attention inputs of ``calibration``'s tokens:
            activation-aware SVD, :func:`~qkmla.convert.gqa_fit.latent_factors`). Both are exact at full rank.
        calibration: [B, T] token ids run through the source to measure its keys and attention inputs;
            needed by "principal" and "activations", optional otherwise (then the report measures how much
            key energy the RoPE key's mix holds).

    Returns:
        (model, :class:`GQAConversionReport`): the converted model in eval mode, in the source's dtype and
        device, with its generation config.

    Raises:
        ValueError before any work, naming the argument: another architecture or a source the conversion
        cannot take (model), a rank out of range (kv_lora_rank), a RoPE width the head cannot give
        (rope_dim, rope_pairs), an unknown rope_key, calibration that is not token ids of the model.
    """
    import transformers

    from ..integrations.transformers.load import _experts_for_dtype
    from ..integrations.transformers.model import apply_latent_attention
    from ..integrations.hub.record import record_groups

    hidden, H, G, D = source_attention_shape(model)
    check_loaded(model)
    max_rank = min(2 * G * D, hidden)
    # NumPy ints are the widths they hold (np.int64(16) was refused as "expected an int from 1 to ..., got
    # np.int64(16)")
    kv_lora_rank, rope_dim = as_int(kv_lora_rank), as_int(rope_dim)
    _check_rank(kv_lora_rank, max_rank)
    rope_dim, rope_pairs = resolve_rope(D, rope_dim, rope_pairs)
    pairs, theta = kept_rope_pairs(D, rope_dim, rope_pairs, rope_theta_of(model.config))
    check_bool("keep_norm", keep_norm)
    check_calibration(calibration, rope_key, latent, model.config.vocab_size)
    weight = next(model.parameters())
    if weight.dtype == torch.float16:
        raise ValueError(f"model: {FLOAT16_CANNOT}; convert a float32 or bfloat16 model")

    scope = SCOPES[type(model).__name__]
    # A weight per channel (OLMoE's) goes into the RoPE key's rows when the norm is kept (below).
    weighted_rows = keep_norm and scope == "projection"
    moments, inputs = calibration_moments(model, calibration, pairs, G, D, weighted_rows) if calibration is not None \
        else ([None] * len(model.model.layers), None)
    factors = latent_factors(model, G, D, inputs if latent == "activations" else None)
    full_rank = kv_rank(model, G, D)
    r = full_rank if kv_lora_rank is None else kv_lora_rank
    config = deepseek_config(model, r, rope_dim, theta)
    dst = (transformers.DeepseekV2ForCausalLM if config.model_type == "deepseek_v2"
           else transformers.DeepseekV3ForCausalLM)(config)
    dst = dst.to(device=weight.device, dtype=weight.dtype).eval()
    _experts_for_dtype(dst, None)  # a float64 MoE model's experts eager: grouped_mm takes no float64
    others = {k: v for k, v in model.state_dict().items() if ".self_attn." not in k}
    missing, unexpected = dst.load_state_dict(others, strict=False)
    # A DeepSeek-V2 MoE layer without a shared expert still has its (empty) module.
    left = [k for k in missing if ".self_attn." not in k and dst.state_dict()[k].numel()]
    if left or unexpected:
        raise ValueError(f"model: its tensors do not map onto the DeepSeek model (missing {left[:3]}, unexpected "
                         f"{unexpected[:3]})")
    dst.generation_config = copy.deepcopy(model.generation_config)

    # The kept pairs' source dims (j, j + D/2) in the converted model's RoPE order: V3's NeoX halves, or
    # V2's interleaved pairs (2k, 2k + 1).
    order = [d for j in pairs for d in (j, j + D // 2)] if config.model_type == "deepseek_v2" \
        else pairs + [j + D // 2 for j in pairs]
    idx = torch.tensor(order, device=weight.device)
    pair_of = torch.tensor([pairs.index(d if d < D // 2 else d - D // 2) for d in order])  # [d_r]: its kept pair
    group_of = torch.arange(H) // (H // G)  # [H]: each query head's KV group
    fold = math.sqrt((D + rope_dim) / D)  # tau (D + d_r)^-1/2 -> the source's D^-1/2
    report = GQAConversionReport(num_kv_groups=G, head_dim=D, scope=scope, rank=r, max_rank=max_rank, kv_lora_rank=r + 1,
                                 rope_dim=rope_dim, rope_pairs=rope_pairs, rope_theta=theta, kept_pairs=pairs,
                                 keep_norm=keep_norm, rope_key=rope_key, latent=latent)
    eps = dst.model.layers[0].self_attn.kv_a_layernorm.variance_epsilon
    norms = []
    with torch.no_grad():
        for src_layer, dst_layer, (U, S, B), moment in zip(model.model.layers, dst.model.layers, factors, moments):
            s, d = src_layer.self_attn, dst_layer.self_attn
            f64 = dict(dtype=torch.float64)
            w_key, s_query, energy = rope_key_mix(moment, rope_key, len(pairs), G)
            if energy is not None:
                report.rope_key_energy.append(energy)
            w_key = w_key[pair_of].T.to(weight.device)[:, :, None]  # [G, d_r, 1]: each group's rows' weight
            s_query = s_query[pair_of][:, group_of].T.to(weight.device)[:, :, None]  # [H, d_r, 1]
            wq = s.q_proj.weight.to(**f64).view(H, D, hidden)
            wk = s.k_proj.weight.to(**f64).view(G, D, hidden)
            # A row per head: Qwen3's weight is shared by the heads, OLMoE's has one per channel.
            gq = s.q_norm.weight.to(**f64).expand(H, D) if scope == "head" else s.q_norm.weight.to(**f64).view(H, D)
            gk = s.k_norm.weight.to(**f64).expand(G, D) if scope == "head" else s.k_norm.weight.to(**f64).view(G, D)
            q_content = wq if keep_norm else wq.index_fill(1, idx, 0.0) * fold
            q_rope = (wq[:, idx] if keep_norm else wq[:, idx] * fold) * s_query
            d.q_proj.weight.copy_(torch.cat((q_content, q_rope), dim=1).flatten(0, 1))

            # the constant channel: |u| = |B_r x| <= |B_r|_2 |x|, |x| <= max|input_layernorm| sqrt(hidden), and
            # |B_r|_2 is 1 for the weights' orthonormal rows, at most sqrt(r) for the activation fit's unit rows
            u_bound = float(src_layer.input_layernorm.weight.abs().max()) * math.sqrt(hidden) * float(
                torch.linalg.matrix_norm(B[:r], ord=2))
            M = SCALE_MARGIN * max(u_bound, 1.0)
            if M > FLOAT32_MAX_M:
                raise ValueError(f"model: layer {len(report.constant)}'s input_layernorm weights are too large for "
                                 f"the constant latent channel ({M:.3g} > {FLOAT32_MAX_M:g})")
            report.constant.append(M)
            report.scale_bound = max(report.scale_bound, (u_bound ** 2 + (r + 1) * eps) / (2 * M * M))
            zero = torch.zeros(1, hidden, **f64)
            # exact for G = 1. A weight per channel (OLMoE) differs between the dims of a rotated pair, so
            # it cannot move to the query past the rotation: it goes into the RoPE key's rows.
            k_rope = ((wk[:, idx] * gk[:, idx, None] if weighted_rows else wk[:, idx]) * w_key).sum(dim=0)
            d.kv_a_proj_with_mqa.weight.copy_(torch.cat((B[:r], zero, k_rope)))
            d.kv_a_proj_with_mqa.bias.zero_()
            d.kv_a_proj_with_mqa.bias[r] = M
            d.kv_a_layernorm.weight.copy_(torch.cat((torch.full((r,), M / math.sqrt(r + 1), **f64),
                                                     torch.zeros(1, **f64))))
            up = torch.cat((U[:, :r] * S[:r], torch.zeros(U.shape[0], 1, **f64)), dim=1).view(G, 2 * D, r + 1)
            d.kv_b_proj.weight.copy_(up.repeat_interleave(H // G, dim=0).flatten(0, 1))
            d.o_proj.weight.copy_(s.o_proj.weight)
            d.o_proj.bias.zero_()
            report.latent_error.append(float(S[r:].square().sum().sqrt() / S.square().sum().sqrt()))
            norms.append((gq, gk))

    record_groups(dst.config, G)
    eps_qk = float(model.config.rms_norm_eps)
    apply_latent_attention(dst, qk_norm=QKNormConfig("rms", "content", eps=eps_qk, scope=scope) if keep_norm
                           else None)
    if keep_norm:
        with torch.no_grad():
            for layer, (gq, gk) in zip(dst.model.layers, norms):
                a = layer.self_attn
                if scope == "head":  # one weight for every head
                    a.q_norm.content.weight.copy_(gq[0].index_fill(0, idx, 0.0) * fold)
                    a.q_norm.rope.weight.copy_(gq[0, idx] * fold)
                    a.k_norm.content.weight.copy_(gk[0])
                    a.k_norm.rope.weight.copy_(gk[0, idx])
                    continue
                # A row per head; the key's RoPE weight is in kv_a_proj_with_mqa's rows (above).
                a.q_norm.content.weight.copy_(gq.index_fill(1, idx, 0.0) * fold)
                a.q_norm.rope.weight.copy_(gq[:, idx] * fold)
                a.k_norm.content.weight.copy_(gk)
                a.k_norm.rope.weight.fill_(1.0)
    _describe(report, r >= full_rank)
    return dst.eval(), report


def _describe(report: GQAConversionReport, full_rank: bool) -> None:
    """Fill the report's lists of exact and approximate parts."""
    exact, approx = report.exact, report.approximate
    G, D, r = report.num_kv_groups, report.head_dim, report.rank
    exact += ["embeddings, MLP, norms and LM head (the source's tensors)", "o_proj", "the query projection"]
    if report.keep_norm:
        if report.scope == "projection":
            exact += ["the query statistic (one per token over every head's content block, each the whole "
                      "source head)", "the key statistic (one per token over every KV group, content mode)"]
        else:
            exact += ["the query statistic (the content block holds the whole head)",
                      "every KV group's key statistic (content mode)"]
    else:
        approx.append("the QK norm is dropped (its statistic and weights): another function")
    if full_rank:
        exact.append(f"the latent (rank {r} holds [W_K ; W_V])")
    else:
        weighted = ", weighted by the calibration tokens' attention inputs" if report.latent == "activations" else ""
        approx.append(f"the latent: rank {r} of [W_K ; W_V] (relative error per layer{weighted} "
                      f"{', '.join(f'{e:.3g}' for e in report.latent_error)})")
    if report.rope_dim < D:
        approx.append(f"{(D - report.rope_dim) // 2} of {D // 2} RoPE pairs are not rotated (partial RoPE)")
    if G > 1:
        how = "the mean of their rows" if report.rope_key == "mean" else "each kept pair's principal mix of their rows"
        held = (f"; it holds {', '.join(f'{e:.3g}' for e in report.rope_key_energy)} of the kept pairs' key energy "
                f"per layer on the calibration tokens") if report.rope_key_energy else ""
        approx.append(f"the RoPE key is shared by the {G} KV groups ({how}{held})")
    else:
        exact.append("the RoPE key (G = 1)" + ("" if report.rope_dim == D else ", for the kept pairs"))
    approx.append(f"kv_a_layernorm scales each token's values and k^R by alpha, 1 - alpha <= {report.scale_bound:.2g} "
                  f"(the constant channel)")


CALIBRATION_WINDOW = 256  # tokens per calibration window (fewer if the model's context is shorter)
CALIBRATION_TOKENS = 16384  # tokens of calibration_text used, by default (all of a shorter text)


def read_calibration_ids(tokenizer, path, tokens: Optional[int]) -> torch.Tensor:
    """The first ``tokens`` token ids of the UTF-8 text file ``path`` (None: up to
    :data:`CALIBRATION_TOKENS`, all of a shorter text), read no further than they need. ValueError
    naming calibration_text for a text that is not UTF-8 (it was decoded with replacement characters,
    which the fit then took as text), and naming calibration_tokens for a count the text does not
    hold (fewer were used without a word; ``convert`` refuses the same)."""
    wanted = CALIBRATION_TOKENS if tokens is None else tokens
    try:
        with open(path, encoding="utf-8") as f:
            # A tokenizer gives at most one token per character and more per word: 64 characters a token
            # is ample, not the whole file. Read in pieces, since read(n) makes a buffer of n (a count
            # near 2**63 overflowed it) and a file's size can read 0 while it holds text (/proc, FUSE).
            parts, read = [], 0
            while read < 64 * wanted and (part := f.read(min(64 * wanted - read, 1 << 20))):
                parts.append(part)
                read += len(part)
            text = "".join(parts)
    except UnicodeDecodeError as e:
        raise ValueError(f"calibration_text: cannot read {path} as UTF-8 text ({e}); give the text in "
                         "UTF-8") from None
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    if tokens is not None and len(ids) < tokens:
        raise ValueError(f"calibration_tokens: {path} gives {len(ids)} tokens, fewer than the {tokens} asked for; "
                         "give a smaller count, more text, or leave it out (all of a text shorter than "
                         f"{CALIBRATION_TOKENS})")
    return ids[:wanted]


def _expert_shape(name: str, want: dict) -> Optional[tuple]:
    """The shape the model needs of one expert's stored weight (OLMoE's checkpoints store
    ``mlp.experts.E.{gate,up,down}_proj.weight``; the model fuses them as ``mlp.experts.gate_up_proj``
    [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I]), or None for any other name."""
    m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
    if m is None:
        return None
    fused = want.get(f"{m[1]}.down_proj" if m[3] == "down" else f"{m[1]}.gate_up_proj")
    if fused is None or len(fused) != 3:
        return None
    return tuple(fused[1:]) if m[3] == "down" else (fused[1] // 2, fused[2])


def _check_weight_shapes(src, model_class, config) -> None:
    """Every tensor of the checkpoint in ``src`` that the model ``config`` describes has under the same name
    has the model's shape (read from the shard headers, before any weight loads): a config.json edited to
    another head_dim failed in transformers' loader as an internal error, its mismatch report above."""
    from ..integrations.hub.checkpoint import CONFIG, INDEX, SINGLE, _open, _weight_map
    from .stream import _meta_build

    if not (src / INDEX).is_file() and not (src / SINGLE).is_file():
        return  # weights in pytorch_model.bin (no header to read): transformers' loader reads them, as before
    weight_map, _ = _weight_map(src)
    try:
        with _meta_build():  # the structure alone, no storage
            want = {k: tuple(v.shape) for k, v in model_class._from_config(config).state_dict().items()}
    except (RuntimeError, ValueError, TypeError, ArithmeticError) as e:
        raise ValueError(f"src: {src / CONFIG} describes a model transformers cannot build "
                         f"({str(e).splitlines()[0]})") from None
    for name, file in sorted(weight_map.items()):
        expected = want.get(name) or _expert_shape(name, want)
        if expected is not None:
            with _open(src / file) as f:
                got = tuple(f.get_slice(name).get_shape())
            if got != expected:
                raise ValueError(f"src: {src / file}: {name} has shape {got}; the config in {src / CONFIG} needs "
                                 f"{expected}")


def convert_gqa_checkpoint(src, out, *, kv_lora_rank: Optional[int] = None, rope_dim: Optional[int] = None,
                           rope_pairs: Optional[str] = None, keep_norm: bool = True,
                           dtype: Optional[torch.dtype] = None,
                           overwrite: bool = False, rope_key: str = "mean", latent: str = "weights",
                           calibration_text=None, calibration_tokens: Optional[int] = None) -> GQAConversionReport:
    """``qkmla convert-gqa``: the Qwen3 or OLMoE checkpoint directory ``src`` converted (:func:`convert_gqa`)
    and written to ``out`` with its tokenizer and generation config, for
    ``qkmla.integrations.transformers.from_pretrained`` and ``qkmla generate --hf``. ``out`` is checked and replaced as
    ``qkmla convert`` does (:func:`~qkmla.convert.qk_norm.check_convert_paths`). ``calibration_text``: a
    UTF-8 text file whose first ``calibration_tokens`` tokens (through the checkpoint's tokenizer, in windows
    of up to 256) are :func:`convert_gqa`'s calibration; None: up to :data:`CALIBRATION_TOKENS`, all of a
    shorter text (an explicit count the text does not hold is refused: :func:`read_calibration_ids`).

    Raises:
        ValueError before any weight is read: the paths (src, out, calibration_text), a config.json that is not a
        Qwen3 or OLMoE model's (src), and the arguments as :func:`convert_gqa` names them.
    """
    import transformers

    from ..integrations.hub.checkpoint import CONFIG, load_tokenizer, read_hf_config, transformers_config
    from .qk_norm import check_convert_paths, check_dtype, converting_into, write_checkpoint

    src, out = check_convert_paths(src, out, overwrite, [("calibration_text", calibration_text)])
    check_dtype(dtype)
    # NumPy ints are the numbers they hold, as convert_gqa takes them
    kv_lora_rank, rope_dim, calibration_tokens = (as_int(v) for v in (kv_lora_rank, rope_dim, calibration_tokens))
    hf_config = read_hf_config(src, "src")
    model_type = hf_config.get("model_type")
    if model_type is None:  # a qkmla training run's config.json (it names none): "describes a None model"
        raise ValueError(f"src: {src / CONFIG} names no model_type, so it is not a transformers checkpoint; "
                         f"convert-gqa converts {sorted(MODEL_TYPES)} models (a qkmla training run's config.json "
                         "has none: `qkmla generate RUN` samples from one)")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"src: {src / CONFIG} describes a {model_type!r} model; convert-gqa converts "
                         f"{sorted(MODEL_TYPES)} models")
    if rope_key not in ROPE_KEYS:
        raise ValueError(f"rope_key: expected one of {ROPE_KEYS}, got {rope_key!r}")
    if latent not in LATENTS:
        raise ValueError(f"latent: expected one of {LATENTS}, got {latent!r}")
    count = calibration_tokens
    if count is not None and (not is_int(count) or not 2 <= count < 2**63):
        raise ValueError(f"calibration_tokens: expected an int >= 2 and below 2**63, or None, got {count!r}")
    if calibration_text is not None:
        check_input_file("calibration_text", calibration_text, "calibration text")
    if calibration_text is None and (rope_key == "principal" or latent == "activations"):
        what = "rope_key 'principal' fits its mix to the keys" if rope_key == "principal" else \
            "latent 'activations' weights the factorization by the attention inputs"
        raise ValueError(f"calibration_text: {what} of calibration text; give a text file like the model's data")
    # The rank and RoPE width against the source's shape, from its config: refused before the weights load.
    config = transformers_config(src, "src")  # a hand-edited config.json: one line, not an internal error
    hidden, _, G, D = config_attention_shape(MODEL_TYPES[model_type], config)
    _check_weight_shapes(src, getattr(transformers, MODEL_TYPES[model_type]), config)
    _check_rank(kv_lora_rank, min(2 * G * D, hidden))
    kept_rope_pairs(D, *resolve_rope(D, rope_dim, rope_pairs), rope_theta_of(config))
    if dtype == torch.float16:
        raise ValueError(f"dtype: {FLOAT16_CANNOT}; expected float32, bfloat16 or float64")
    if dtype is None and getattr(config, "dtype", None) == torch.float16:  # loaded as stored
        raise ValueError(f"src: {src} stores float16 weights, and {FLOAT16_CANNOT}; convert them as float32 or "
                         "bfloat16 (--dtype)")
    try:
        tokenizer = load_tokenizer(src)
    except (OSError, ValueError, ImportError):  # a checkpoint without tokenizer files is still converted
        tokenizer = None
    calibration = None
    if calibration_text is not None:
        if tokenizer is None:
            raise ValueError(f"calibration_text: {src} has no tokenizer to read {calibration_text} with")
        ids = read_calibration_ids(tokenizer, calibration_text, calibration_tokens)
        window = min(CALIBRATION_WINDOW, int(hf_config.get("max_position_embeddings") or CALIBRATION_WINDOW), len(ids))
        if window < 2:
            raise ValueError(f"calibration_text: {calibration_text} gives {len(ids)} tokens; at least 2 are needed")
        calibration = ids[:len(ids) - len(ids) % window].view(-1, window)
    with converting_into(src, out, overwrite) as (target, state):  # a second conversion into out is refused
        try:
            model = getattr(transformers, MODEL_TYPES[model_type]).from_pretrained(
                src, local_files_only=True, **({"dtype": dtype} if dtype is not None else {}))
        except RuntimeError as e:
            # Tensors the shape check cannot pair with the model's by name (OLMoE's per-expert weights, which the
            # model fuses) that disagree with the config: transformers' mismatch report, then an internal error.
            if "ignore_mismatched_sizes" not in str(e) and "size mismatch" not in str(e):
                raise
            raise ValueError(f"src: the weights in {src} do not have the shapes {src / CONFIG} describes "
                             f"({' '.join(x.strip() for x in str(e).splitlines() if x.strip())[:300]})") from None
        converted, report = convert_gqa(model, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, rope_pairs=rope_pairs,
                                        keep_norm=keep_norm, rope_key=rope_key, latent=latent,
                                        calibration=calibration)
        write_checkpoint(converted, tokenizer, target, state)
    return report
