"""The MLA families transformers ships, one row each: which ``apply_latent_attention`` takes, how it
reads each one's config, and why it refuses the others.

An MLA attention layer is recognised by its structure (:func:`is_mla_attention`: DeepSeek's
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` and a query projection,
under a config with ``kv_lora_rank``), and its family by the config's ``model_type``. The family's
row says what the structure cannot:

    host        how its attention differs from DeepSeek-V3's (:class:`HostAttention`: the RoPE
                layout, LongCat-Flash's LoRA scales, Mistral 4's position-dependent query
                scale, Ling's per-head output gate), read from its config
    mla_layers  which decoder layers are MLA (hybrids: Kimi-Linear, Ling mix in linear attention,
                which stays transformers' own, its state in transformers' own cache layers)
    build       how its layers are built: a key of ``model.BUILDERS`` ("dense": the adapter's
                ``LatentAttention.from_hf``; "sparse": ``sparse.SparseLatentAttention.from_hf``, for
                DeepSeek's sparse attention, a lightning indexer choosing the top-k cached tokens);
                None for a refused family, whose ``reason`` says what cannot map

Every family's parity with transformers is ``tests/integrations/transformers/test_families.py``;
the docs' table (docs/interop.md) is :func:`markdown_table` of :data:`FAMILIES`, checked there.

Nothing here imports transformers (the rows name its classes) or the adapter's layers (the rows
name their builders).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from ...attention.mla import MLA

ROPE_LAYOUTS = ("interleaved", "halves", "none")
# The output gates of HostAttention.output_gate, by kind: the name of transformers' gate projection
OUTPUT_GATES = {"head": "g_proj", "channel": "gate_proj", "query": "q_gate_proj"}
STATUSES = ("supported", "sparse", "refused")
# The transformers versions the parity tests run on (CI's oldest and newest)
TESTED_VERSIONS = ("5.4.0", "5.24.0")
# GLM-5's DSA is taken from the first tested transformers whose indexer keeps its keys in the cache
# (cache.update_indexer); 5.4.0's keeps them on the module (_cached_keys) and is refused (sparse.py)
SPARSE_GLM_SINCE = "5.19.0"


@dataclass(frozen=True)
class HostAttention:
    """How one family's MLA attention differs from DeepSeek-V3's, read from its config.

    rope: "interleaved" (DeepSeek's pairs (x0, x1), (x2, x3), ...), "halves" (NeoX's, MiniCPM3's) or
        "none" (Kimi-Linear's MLA layers: NoPE, the shared key part is never rotated).
    query_scale: q [B, T, h, d_n + d_r] times this before any norm or RoPE (LongCat-Flash's
        ``mla_scale_q_lora`` = sqrt(hidden_size / q_lora_rank)).
    latent_scale: c [B, T, d_c] times this after ``kv_a_layernorm`` (LongCat-Flash's
        ``mla_scale_kv_lora`` = sqrt(hidden_size / kv_lora_rank)); keys and values both scale.
    position_temperature: (beta, L) for Mistral 4's position-dependent query scale
        1 + beta log(1 + floor(position / L)) (transformers' ``get_llama_4_attn_scale``), or None.
    output_gate: None, or how the heads' outputs [B, T, h, d_v] are gated before ``o_proj``, a key of
        :data:`OUTPUT_GATES`: "head", times sigmoid(g_proj(x)) [B, T, h], in float32 (Ling's
        ``BailingHybridAttention``); "channel", times sigmoid(gate_proj(x)) [B, T, h, d_v], in the
        hidden dtype (HY-V4's ``HYV4Attention``); "query", times sigmoid of the last d_v columns of each head's
        row of the fused query projection q_gate_proj [B, T, h, d_n + d_r + d_v], in float32 (AXK2's
        ``AXK2Attention``, which has no ``q_b_proj``: the layer's query is the first d_n + d_r columns,
        ``transformers.attention.LatentAttention.raw_query``).
    attention_sinks: the attention has a learned per-head sink logit (transformers' ``sinks`` [h], HY-V4's),
        adopted as the layer's ``MLA.sinks`` (``qkmla.attention.sinks``).
    yarn_scale: the softmax scale takes YaRN's mscale² (DeepSeek's ``yarn_apply_mscale``); False
        where the family's attention uses (d_n + d_r) ** -0.5 alone.
    shared_topk: the sparse attention's cross-layer top-k sharing (GLM-5's ``indexer_types``): the
        attention takes the previous layer's choice (``prev_topk_indices`` [B, T, topk] columns) where
        its own layer has no indexer (a "shared" layer), and returns its choice as a third output
        (output, weights, topk) for the next layer.
    """

    rope: str = "interleaved"
    query_scale: float = 1.0
    latent_scale: float = 1.0
    position_temperature: Optional[tuple[float, int]] = None
    output_gate: Optional[str] = None
    yarn_scale: bool = True
    shared_topk: bool = False
    attention_sinks: bool = False

    def __post_init__(self):
        if self.rope not in ROPE_LAYOUTS:
            raise ValueError(f"rope: expected one of {ROPE_LAYOUTS}, got {self.rope!r}")
        if self.output_gate is not None and self.output_gate not in OUTPUT_GATES:
            raise ValueError(f"output_gate: expected None or one of {tuple(OUTPUT_GATES)}, got {self.output_gate!r}")

    @property
    def gate_name(self) -> Optional[str]:
        """The name of transformers' output-gate projection in the family's attention, or None."""
        return OUTPUT_GATES[self.output_gate] if self.output_gate is not None else None

    @property
    def is_deepseek(self) -> bool:
        """True when the layer computes what DeepSeek-V3's does (only the RoPE layout may differ)."""
        return (self.query_scale == 1.0 and self.latent_scale == 1.0 and self.position_temperature is None
                and self.output_gate is None and not self.attention_sinks)


def _rope(config) -> str:
    return "interleaved" if getattr(config, "rope_interleave", True) else "halves"


def _deepseek(config) -> HostAttention:
    """DeepSeek-V3's and its copies': interleaved pairs unless ``rope_interleave`` is False."""
    return HostAttention(rope=_rope(config))


def _interleaved(config) -> HostAttention:
    """Always interleaved pairs (DeepSeek-V2's complex rotation; LongCat-Flash's and Ling's)."""
    return HostAttention(rope="interleaved")


def _minicpm3(config) -> HostAttention:
    """NeoX halves, whatever the config says (``apply_rotary_pos_emb``)."""
    return HostAttention(rope="halves")


def _mistral4(config) -> HostAttention:
    rope = getattr(config, "rope_parameters", None) or {}
    beta = rope.get("llama_4_scaling_beta")
    temperature = (float(beta), int(rope["original_max_position_embeddings"])) if beta else None
    return HostAttention(rope=_rope(config), position_temperature=temperature)


def _longcat_flash(config) -> HostAttention:
    return HostAttention(rope="interleaved", query_scale=math.sqrt(config.hidden_size / config.q_lora_rank),
                         latent_scale=math.sqrt(config.hidden_size / config.kv_lora_rank))


def _kimi_linear(config) -> HostAttention:
    return HostAttention(rope="none", yarn_scale=False)


def _bailing_hybrid(config) -> HostAttention:
    return HostAttention(rope="interleaved", output_gate="head")


def _glm_dsa(config) -> HostAttention:
    """GLM-5's DSA (glm_moe_dsa): DeepSeek-V3.2's attention, interleaved pairs, and cross-layer top-k sharing."""
    return HostAttention(rope="interleaved", shared_topk=True)


def _hy_v4(config) -> HostAttention:
    """HY-V4's: DeepSeek-V3.2's sparse attention with RoPE in halves, attention sinks, a per-channel output
    gate, and cross-layer top-k sharing (``indexer_types``; every layer returns its choice)."""
    return HostAttention(rope="halves", output_gate="channel", attention_sinks=True, shared_topk=True)


def _axk2(config) -> HostAttention:
    """AXK2's: DeepSeek-V3.2's sparse attention, its query and a per-channel output gate from one fused
    projection (q_gate_proj of [q_a_layernorm(q_a_proj(x)), q_a_proj(x)])."""
    return HostAttention(rope="interleaved", output_gate="query")


def _every_layer(config) -> list[bool]:
    return [True] * config.num_hidden_layers


def _longcat_layers(config) -> list[bool]:
    """LongCat-Flash's decoder layers (``num_layers``; ``num_hidden_layers`` counts its two attention
    modules each, as its cache does)."""
    return [True] * config.num_layers


def _full_attention_layers(config) -> list[bool]:
    """Hybrids: the decoder layers ``layer_types`` calls "full_attention" are MLA."""
    return [kind == "full_attention" for kind in config.layer_types]


@dataclass(frozen=True)
class Family:
    """One MLA family of transformers.

    model_type: its config's ``model_type``.
    classes: transformers' classes of the whole model and of the inner model holding the decoder
        layers (``layers``) that ``apply_latent_attention`` takes.
    status: "supported" or "refused" ("sparse": a sparse attention family refused for its reason).
    reason: why a family that is not supported is refused (shown in the error and the docs).
    since: the oldest transformers that ships it, or None where the oldest tested one (5.4.0) does.
    taken_since: the oldest transformers whose form of the family qkmla takes, where that is later than
        ``since`` (GLM-5's DSA: 5.4's indexer is refused), or None; the parity tests skip older ones,
        saying so, and the docs' tested range starts there.
    host: its :class:`HostAttention` from its config.
    mla_layers: from its config, which decoder layers are MLA ([num_hidden_layers] bool).
    build: the name of the builder of its layers in ``model.BUILDERS`` (a function
        ``(hf_attention, settings, hf_rotary=, host=, **overrides)`` -> the layer that replaces one of
        its MLA attention modules; named, not held, so that this table imports no layer); None where
        none is built (refused).
    note: what the docs say of it besides.
    """

    model_type: str
    classes: tuple[str, ...]
    status: str = "supported"
    reason: str = ""
    since: Optional[str] = None
    taken_since: Optional[str] = None
    host: Callable = _deepseek
    mla_layers: Callable = _every_layer
    build: Optional[str] = "dense"
    note: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status: expected one of {STATUSES}, got {self.status!r}")
        if (self.status == "supported") != (self.build is not None):
            raise ValueError(f"{self.model_type}: a supported family builds its layers (build), a refused one "
                             f"has no build")

    @property
    def causal_lm(self) -> str:
        return self.classes[0]


def _sparse(model_type: str, classes: tuple[str, ...], reason: str, since: Optional[str] = None,
            note: str = "") -> Family:
    """A family with DeepSeek's sparse attention (a lightning indexer choosing the top-k cached tokens)
    whose attention cannot map onto the sparse adapter, for ``reason``."""
    return Family(model_type, classes, status="sparse", reason=reason, since=since, build=None, note=note)


# Why each refused sparse family's attention does not map onto MLA with a top-k indexer (sparse.py)
REASONS = {
    "glm5_next": ("its indexer scores pools of index_kpool tokens (k-pool compression, Glm5NextTextIndexer) and reads "
                  "transformers' cache layer's key tensor (cache.layers[i].keys) to size them, which a latent cache "
                  "layer does not have; its MLA layers are also behind per-layer hyper-connections"),
    "mistral_large4": ("layers share one latent cache across layers (kv_sharing_modes 'reuse': layers without "
                       "kv_a_proj_with_mqa read another layer's latent), some layers have no RoPE part at all "
                       "(no_rope_layers: d_r = 0 in that layer alone), and the query takes a learned per-head "
                       "log-position scale (MistralLarge4TextSoftmaxScaling); its indexer has no query LoRA input"),
    "hy_v4_vl": ("its text attention (HY-V4's, which is supported) rotates with a multimodal RoPE: three position ids "
                 "per token (temporal, height, width; position_ids [3, B, T], mrope_section), which the latent "
                 "cache's one RoPE position per token does not give"),
    "dots3_note": ("sliding-window attention layers (layer_types 'sliding_attention') and per-layer configs "
                   "(per_layer_config) beside the indexed layers, an RMSNorm on the shared RoPE key "
                   "(k_rope_only_layernorm) that MLA's latent path does not apply, and a LoRA scale on the "
                   "indexer's query input (q_resid * q_lora_scale), which the sparse adapter does not give it"),
}


FAMILIES: tuple[Family, ...] = (
    Family("deepseek_v2", ("DeepseekV2ForCausalLM", "DeepseekV2Model"), host=_interleaved),
    Family("deepseek_v3", ("DeepseekV3ForCausalLM", "DeepseekV3Model"),
           note="Kimi K2 / K2.5 and Moonlight checkpoints load as DeepSeek-V3"),
    Family("sarvam_mla", ("DeepseekV3ForCausalLM", "DeepseekV3Model"), since="5.24.0",
           note="transformers builds it with the DeepSeek-V3 classes (its own config class)"),
    Family("glm4_moe_lite", ("Glm4MoeLiteForCausalLM", "Glm4MoeLiteModel")),
    Family("youtu", ("YoutuForCausalLM", "YoutuModel")),
    Family("mistral4", ("Mistral4ForCausalLM", "Mistral4Model"), host=_mistral4,
           note="the position-dependent query scale (llama_4_scaling_beta) applied on every path"),
    Family("longcat_flash", ("LongcatFlashForCausalLM", "LongcatFlashModel"), host=_longcat_flash,
           mla_layers=_longcat_layers,
           note="two MLA attention modules per decoder layer; the LoRA scales applied to q and the latent"),
    Family("minicpm3", ("MiniCPM3ForCausalLM", "MiniCPM3Model"), since="5.24.0", host=_minicpm3,
           note="RoPE in NeoX halves"),
    Family("axk1", ("AXK1ForCausalLM", "AXK1Model"), since="5.24.0"),
    Family("kimi_linear", ("KimiLinearForCausalLM", "KimiLinearModel"), since="5.24.0", host=_kimi_linear,
           mla_layers=_full_attention_layers,
           note="hybrid: its linear-attention layers stay transformers' own; MLA layers are NoPE"),
    Family("bailing_hybrid", ("BailingHybridForCausalLM", "BailingHybridModel"), since="5.24.0",
           host=_bailing_hybrid, mla_layers=_full_attention_layers,
           note="hybrid: its linear-attention layers stay transformers' own; the per-head output gate applied"),
    Family("deepseek_v32", ("DeepseekV32ForCausalLM", "DeepseekV32Model"), since="5.24.0", host=_interleaved,
           build="sparse", note="sparse attention: transformers' indexer picks the top-k latent rows the absorbed "
                                "decode reads (sparse.py)"),
    Family("glm_moe_dsa", ("GlmMoeDsaForCausalLM", "GlmMoeDsaModel"), taken_since=SPARSE_GLM_SINCE, host=_glm_dsa,
           build="sparse", note="sparse attention as DeepSeek-V3.2's, and \"shared\" layers reusing the previous "
                                "layer's top-k (indexer_types); transformers 5.4's indexer (its own key cache) is "
                                "refused"),
    _sparse("glm5_next", ("Glm5NextForConditionalGeneration", "Glm5NextTextModel"), REASONS["glm5_next"],
            since="5.24.0", note="also a hybrid with linear-attention layers"),
    _sparse("mistral_large4", ("MistralLarge4ForConditionalGeneration", "MistralLarge4TextModel"),
            REASONS["mistral_large4"], since="5.24.0"),
    Family("hy_v4", ("HYV4ForCausalLM", "HYV4Model"), since="5.24.0", host=_hy_v4, build="sparse",
           note="sparse attention as DeepSeek-V3.2's with attention sinks (the decode op's log-sum-exp), the "
                "per-channel output gate (gate_proj), RoPE in halves and \"shared\" layers reusing the previous "
                "layer's top-k (indexer_types); its decoder's hyper-connections stay transformers' own"),
    _sparse("hy_v4_vl", ("HYV4VLForConditionalGeneration", "HYV4VLTextModel"), REASONS["hy_v4_vl"], since="5.24.0",
            note="hy_v4 with a vision encoder"),
    Family("axk2", ("AXK2ForCausalLM", "AXK2Model"), since="5.24.0", host=_axk2, build="sparse",
           note="sparse attention as DeepSeek-V3.2's; the query and a per-channel output gate from one fused "
                "projection (q_gate_proj), read by the layer's query and output hooks"),
    _sparse("dots3_note", ("Dots3NoteForCausalLM", "Dots3NoteTextModel"), REASONS["dots3_note"], since="5.24.0"),
)

BY_MODEL_TYPE: dict[str, Family] = {f.model_type: f for f in FAMILIES}
SUPPORTED_MODEL_TYPES = tuple(f.model_type for f in FAMILIES if f.status == "supported")


def family_named(model_type: str) -> Optional[Family]:
    """The row of ``model_type`` (qkmla's QK-normed model types included), or None."""
    return BY_MODEL_TYPE.get(model_type.removeprefix("qkmla_") if isinstance(model_type, str) else model_type)


def is_mla_attention(module) -> bool:
    """True for a transformers attention module with MLA's structure: DeepSeek's latent projections
    (``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``), ``o_proj``, a query projection
    (``q_proj``, or ``q_a_proj`` and ``q_b_proj``, or AXK2's ``q_a_proj`` and fused ``q_gate_proj``), and a
    config with ``kv_lora_rank``."""
    has = [getattr(module, name, None) is not None for name in
           ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]
    query = getattr(module, "q_proj", None) is not None or (getattr(module, "q_a_proj", None) is not None and any(
        getattr(module, name, None) is not None for name in ("q_b_proj", "q_gate_proj")))
    return all(has) and query and getattr(getattr(module, "config", None), "kv_lora_rank", None) is not None


def attention_slots(inner) -> list[tuple[object, object]]:
    """Every MLA attention module of an inner ``*Model``'s decoder layers as (owner, key), in cache
    order: ``self_attn`` of each layer, or each entry of a ``self_attn`` list (LongCat-Flash's two)."""
    import torch

    slots = []
    for layer in inner.layers:
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, torch.nn.ModuleList):
            slots += [(attn, i) for i, module in enumerate(attn) if _is_slot(module)]
        elif attn is not None and _is_slot(attn):
            slots.append((layer, "self_attn"))
    return slots


def _is_slot(module) -> bool:
    return isinstance(module, MLA) or is_mla_attention(module)  # patched already, or transformers' own


def get_slot(slot):
    owner, key = slot
    return owner[key] if isinstance(key, int) else getattr(owner, key)


def set_slot(slot, module) -> None:
    owner, key = slot
    if isinstance(key, int):
        owner[key] = module
    else:
        setattr(owner, key, module)


def refusal(family: Family, class_name: str) -> str:
    """The error of a family that is not supported, naming the class and the reason."""
    return (f"model: {class_name} ({family.model_type!r}) is not supported by apply_latent_attention: "
            f"{family.reason}")


def markdown_table() -> str:
    """The docs' table of families (docs/interop.md), from :data:`FAMILIES`."""
    lines = ["| model_type | transformers class | status | transformers tested | notes |",
             "|---|---|---|---|---|"]
    for f in FAMILIES:
        since = f.taken_since or f.since or TESTED_VERSIONS[0]
        status = "supported" if f.status == "supported" else f"refused ({f.reason})"
        tested = f"{since} to {TESTED_VERSIONS[1]}" if since != TESTED_VERSIONS[1] else TESTED_VERSIONS[1]
        lines.append(f"| `{f.model_type}` | `{f.causal_lm}` | {status} | {tested} | {f.note} |")
    return "\n".join(lines)


__all__ = ["BY_MODEL_TYPE", "FAMILIES", "Family", "HostAttention", "OUTPUT_GATES", "REASONS", "ROPE_LAYOUTS", "STATUSES",
           "SUPPORTED_MODEL_TYPES", "TESTED_VERSIONS", "attention_slots", "family_named", "get_slot",
           "is_mla_attention", "markdown_table", "refusal", "set_slot"]
