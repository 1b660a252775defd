"""Attention configs with DeepSeek names, their validation, and named presets.

Every field name of :class:`MLAConfig` matches the Hugging Face
``DeepseekV2Config`` / ``DeepseekV3Config`` field it stands for, so a config maps
one to one (see :func:`qkmla.integrations.hub.config.mla_config_from_hf`). The QK norm is ours:
one :class:`QKNormConfig` (``MATH.md`` defines what each of its fields means), the value that
travels wherever a QK norm is set (``MLAConfig.qk_norm``, ``apply_latent_attention``,
``convert_checkpoint``, a checkpoint's ``"qkmla"`` record, the vLLM plugin, ``qkmla convert``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .ops.mla_decode.backends import check_backend
from .ops.statistic import NORM_KINDS
from .rope import YarnScaling, check_theta, rope_scaling_from
from .utils.checked import check_bool, is_finite_number, is_int, python_numbers

QK_NORMS = (None, *NORM_KINDS)
QK_NORM_MODES = ("blockwise", "unified", "content")
QK_NORM_SCOPES = ("head", "projection")
LP_MAX = 100.0  # the largest p of an Lp norm: 0.5**p stays a normal float32 (2**-126) up to p = 126


def fixed_config(mutable: tuple = ()) -> property:
    """A module's ``config`` attribute, fixed once the module is built.

    The config decides the module's parameters and its arithmetic (which norm, which mode,
    which widths), so a later ``module.config = other`` that changes any of that would leave
    the weights and the paths disagreeing without a word; it is refused, naming the fields.
    Only the ``mutable`` fields (settings of how the same function runs, e.g. MLA's
    ``decode_backend``) may change by assignment.
    """

    def get(module):
        return module.__dict__["_config"]

    def set_(module, value) -> None:
        current = module.__dict__.get("_config")
        if current is not None:
            if type(value) is not type(current):
                raise ValueError(f"config: expected a {type(current).__name__}, got {type(value).__name__}")
            changed = [f.name for f in dataclasses.fields(current)
                       if f.name not in mutable and getattr(value, f.name) != getattr(current, f.name)]
            if changed:
                allowed = f"; only {list(mutable)} may change on a built module" if mutable else ""
                raise ValueError(f"config: {changed} are fixed when the module is built (they decide its weights "
                                 f"and arithmetic){allowed}; build a new {type(module).__name__} from "
                                 f"config.replace(...) and load the weights into it")
        module.__dict__["_config"] = value

    return property(get, set_, doc="The module's config; structural fields are fixed after construction.")


def check_eps(name: str, eps) -> None:
    """A ValueError naming ``name`` unless eps is a number in [0, float32's largest]: a norm adds it in float32 (or
    wider), where eps=1e39 is inf and normalized every vector to exactly 0, without a word."""
    if not is_finite_number(eps) or eps < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {eps!r}")
    if eps > SOFTMAX_SCALE_RANGE[1]:
        raise ValueError(f"{name}: expected a finite number >= 0 and at most float32's largest "
                         f"({SOFTMAX_SCALE_RANGE[1]!r}: the norm adds it in float32), got {eps!r}")


def check_positive_int(name: str, value, allow_none: bool = False) -> None:
    """A ValueError naming ``name`` unless ``value`` is an int in [1, 2**63) (or None, with
    ``allow_none``); shared by every config here and the ones built on them (gpt.py, cache/size.py)."""
    if value is None and allow_none:
        return
    if not is_int(value) or value < 1:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name}: expected {allowed}, got {value!r}")
    if value >= 2**63:  # no tensor has such a size, and the arithmetic on it prints nonsense
        raise ValueError(f"{name}: expected a positive int below 2**63 (a tensor size is an int64), got {value}")


# tau's range: float32's normal numbers. The layers scale float32 (or wider) logits by it, so 1e300 passed
# "finite > 0" and was inf there (and 1e-320 zero): NaN logits from the first forward, without a word.
SOFTMAX_SCALE_RANGE = (2.0 ** -126, float.fromhex("0x1.fffffep+127"))  # torch.finfo(torch.float32) tiny, max


def check_softmax_scale(softmax_scale) -> None:
    """A ValueError naming softmax_scale unless it is None or a number in :data:`SOFTMAX_SCALE_RANGE` (the
    model configs' and TrainConfig's tau; the decode op's per-call scale has its own check). The range keeps tau
    itself finite in float32; the logits tau * q.k can still overflow near its top (1e38 with a QK norm)."""
    low, high = SOFTMAX_SCALE_RANGE
    if softmax_scale is not None and (not is_finite_number(softmax_scale) or not low <= softmax_scale <= high):
        # the bounds as repr: 1.17549e-38 (:g) is below 2**-126, and typed back was refused
        raise ValueError(f"softmax_scale: expected a positive number within float32's normal range ({low!r} to "
                         f"{high!r}) or None, got {softmax_scale!r}")


@dataclass(frozen=True)
class QKNormConfig:
    """A post-up-projection QK norm: one value, checked once, wherever it is set.

    ``MLAConfig(qk_norm=...)``, ``AttentionConfig(qk_norm=...)``, ``apply_latent_attention(model,
    qk_norm=...)`` and ``convert_checkpoint(..., qk_norm=...)`` take it, or a shorthand for it
    (:meth:`of`: a kind name such as ``"rms"``, a dict of these fields, or None for no norm); a
    checkpoint records it as one dict (:meth:`record`), and the vLLM plugin reads it back.

    Args:
        kind: the statistic (``qkmla.ops.statistic``): "rms" (the paper's), "l2" or "lp"; None for
            no norm, which a config keeps only to learn its logit scale.
        mode: "blockwise" normalizes content and RoPE blocks separately (default);
            "unified" uses one statistic over the concatenated [content; rope] vector;
            "content" takes one statistic from the content block alone and applies it to both
            blocks (what a converted GQA model needs when its content block holds the whole
            original head, so its RoPE dims are counted there: MATH.md).
        p: p of the Lp norm (read only when ``kind == "lp"``), in [1, 100] (:data:`LP_MAX`).
        eps: the eps inside the statistic, >= 0.
        scope: what one statistic covers. "head" (default): each query head and each KV group's
            key has its own, and the norm weights are shared by the heads (the paper, Qwen3).
            "projection": one per token over all query heads, and one over all KV groups' keys,
            with a weight per head (OLMoE's RMSNorm over the whole projection: MATH.md,
            "Statistic scope"); the cache then holds one key scalar per token.
        learnable_logit_scale: learn one logit scale per head (Henry et al. QKNorm), initialized
            to the layer's ``softmax_scale``.
    """

    kind: Optional[str] = "rms"
    mode: str = "blockwise"
    p: float = 2.0
    eps: float = 1e-6
    scope: str = "head"
    learnable_logit_scale: bool = False

    def __post_init__(self) -> None:
        python_numbers(self)  # np.int64(2) is the int 2 (utils.checked)
        if self.kind not in QK_NORMS:
            raise ValueError(f"kind: expected one of {QK_NORMS}, got {self.kind!r}")
        if self.mode not in QK_NORM_MODES:
            raise ValueError(f"mode: expected one of {QK_NORM_MODES}, got {self.mode!r}")
        if not is_finite_number(self.p) or not 1 <= self.p <= LP_MAX:
            # Past LP_MAX the statistic leaves float32 however the vector is rescaled (ops.statistic.moment): the
            # largest entry, brought to [0.5, 1), still has |v|^p below float32's range (0.5**1000 is 0), so the
            # sum was 0 and p=1000 normalized every vector to inf, without a word
            raise ValueError(f"p: expected a finite number >= 1 and <= {LP_MAX:g} (a norm needs p >= 1; past "
                             f"{LP_MAX:g} |v|^p of the vector's largest entry leaves float32's range), got {self.p!r}")
        check_eps("eps", self.eps)
        if self.scope not in QK_NORM_SCOPES:
            raise ValueError(f"scope: expected one of {QK_NORM_SCOPES}, got {self.scope!r}")
        check_bool("learnable_logit_scale", self.learnable_logit_scale)
        if self.kind is None:
            given = [f.name for f in dataclasses.fields(self) if f.name not in ("kind", "learnable_logit_scale")
                     and getattr(self, f.name) != f.default]
            if given:
                raise ValueError(f"{given[0]}: only read with a norm; give kind too (e.g. kind='rms')")
        object.__setattr__(self, "p", float(self.p))
        object.__setattr__(self, "eps", float(self.eps))

    @classmethod
    def of(cls, value, name: str = "qk_norm") -> Optional["QKNormConfig"]:
        """``value`` as a QKNormConfig: one itself, a kind name ("rms", "l2", "lp"), a dict of the
        fields (a saved config or a checkpoint's record), or None; None (no norm, no learnable
        scale) for None and for a norm of kind None with a fixed scale. ValueError naming ``name``, and a
        dict's field as ``name.field`` (``qk_norm.eps``)."""
        if isinstance(value, dict):
            unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise ValueError(f"{name}: unknown fields {unknown}; a QK norm has "
                                 f"{[f.name for f in dataclasses.fields(cls)]}")
            try:
                value = cls(**value)
            except ValueError as e:  # a field's refusal, named under the argument the dict was given as
                raise ValueError(f"{name}.{e}") from None
        elif value is None or isinstance(value, str):
            if value not in QK_NORMS:
                raise ValueError(f"{name}: expected one of {QK_NORMS} or a QKNormConfig, got {value!r}")
            value = None if value is None else cls(kind=value)
        elif not isinstance(value, cls):
            raise ValueError(f"{name}: expected a QKNormConfig, one of {QK_NORMS} or a dict of its fields, "
                             f"got {type(value).__name__}")
        return None if value is None or (value.kind is None and not value.learnable_logit_scale) else value

    @property
    def name(self) -> str:
        """How the norm is named in state dicts and messages, e.g. ``rms blockwise``, ``lp(p=3) unified``,
        ``rms content over the projection``; ``no QK norm`` for kind None."""
        if self.kind is None:
            return "no QK norm"
        return (f"{self.kind}" + (f"(p={self.p:g})" if self.kind == "lp" else "") + f" {self.mode}"
                + (" over the projection" if self.scope == "projection" else ""))

    def record(self) -> dict:
        """The fields as one JSON-able dict (a checkpoint's record; :meth:`of` reads it back)."""
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "QKNormConfig":
        return dataclasses.replace(self, **changes)


def check_groups(name: str, groups: int, num_heads: int) -> None:
    """KV groups (heads) must split the query heads evenly."""
    if num_heads % groups:
        allowed = [g for g in range(1, num_heads + 1) if num_heads % g == 0]
        raise ValueError(f"{name}: must divide num_heads={num_heads} (allowed: {allowed}), got {groups}")


def check_rope(rope_dim_name: str, rope_dim: int, rope_theta) -> None:
    """A ValueError naming ``rope_dim_name`` for an odd RoPE width, or naming rope_theta unless it
    is within float32's normal range (:func:`~qkmla.rope.check_theta`)."""
    if rope_dim % 2:
        raise ValueError(f"{rope_dim_name}: RoPE rotates pairs, so it must be even, got {rope_dim}")
    check_theta("rope_theta", rope_theta)


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention with optional post-up-projection QK normalization.

    Shapes (MATH.md names): d = ``hidden_size``, h = ``num_heads``, G = ``num_kv_groups``,
    d_cq = ``q_lora_rank``, d_c = ``kv_lora_rank``, d_n = ``qk_nope_head_dim``,
    d_r = ``qk_rope_head_dim``, d_v = ``v_head_dim``. Head i reads KV group i // (h / G).

    Args:
        qk_norm: the post-up-projection QK norm, a :class:`QKNormConfig` (default: the paper's RMS
            norm, blockwise, per head), or its shorthand (:meth:`QKNormConfig.of`: "rms", "l2",
            "lp", a dict of its fields); None for plain MLA.
        softmax_scale: tau, the logit scale, used as given; None means (d_n + d_r) ** -0.5, times
            DeepSeek's YaRN correction ``rope_scaling.softmax_scale_factor`` when that is set.
        latent_norm_eps: eps of the latent RMSNorms (``q_a_layernorm``, ``kv_a_layernorm``).
        rope_interleave: DeepSeek's layout, rotating pairs (x0, x1), (x2, x3), ...;
            False rotates the halves (GPT-NeoX / Llama layout).
        rope_scaling: None (plain RoPE) or YaRN: a :class:`~qkmla.rope.YarnScaling`, or an HF /
            DeepSeek dict (``{"type": "yarn", "factor": 40, ...}``; rope_type "default" means None),
            converted when the config is built.
        attention_bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` as in HF.
        decode_backend: the backend of the absorbed decode attention (``qkmla.ops.mla_decode``):
            "auto" (the Triton kernel on CUDA when it is installed and fits the widths; the
            C++ kernel on a CPU with AVX-512 BF16 for bfloat16 dense rows; else "torch"),
            "naive" (the float32 reference loop), "torch", "cpu" or "triton".
        attention_sinks: one learned logit per head (``MLA.sinks``, initialized to 0) in the softmax's
            denominator that attends to nothing (gpt-oss, HY-V4; ``qkmla.attention.sinks``), on every
            path at zero cache bytes. False (the default): no sink and no parameter, MLA as it was.
    """

    hidden_size: int = 64
    num_heads: int = 4
    num_kv_groups: int = 4
    q_lora_rank: Optional[int] = 32
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_scaling: Optional[YarnScaling] = None
    qk_norm: Optional[QKNormConfig] = QKNormConfig()
    softmax_scale: Optional[float] = None
    latent_norm_eps: float = 1e-6
    attention_bias: bool = False
    decode_backend: str = "auto"
    attention_sinks: bool = False

    def __post_init__(self) -> None:
        python_numbers(self)  # np.int64(2) is the int 2 (utils.checked)
        for name in ("hidden_size", "num_heads", "num_kv_groups", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("q_lora_rank", self.q_lora_rank, allow_none=True)
        check_groups("num_kv_groups", self.num_kv_groups, self.num_heads)
        check_rope("qk_rope_head_dim", self.qk_rope_head_dim, self.rope_theta)
        # A dict (HF's spelling, or dataclasses.asdict of a saved config) becomes a YarnScaling.
        object.__setattr__(self, "rope_scaling", rope_scaling_from(self.rope_scaling, "rope_scaling"))
        object.__setattr__(self, "qk_norm", QKNormConfig.of(self.qk_norm))
        check_softmax_scale(self.softmax_scale)
        check_eps("latent_norm_eps", self.latent_norm_eps)
        check_backend(self.decode_backend, "decode_backend")
        for name in ("rope_interleave", "attention_bias", "attention_sinks"):
            check_bool(name, getattr(self, name))

    @property
    def qk_head_dim(self) -> int:
        """d_n + d_r, the per-head query/key width of the explicit path."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_groups

    @property
    def has_qk_norm(self) -> bool:
        """Whether the layer normalizes q and k (``qk_norm`` of a kind, not just a learnable scale)."""
        return self.qk_norm is not None and self.qk_norm.kind is not None

    @property
    def learnable_logit_scale(self) -> bool:
        """Whether the logit scale is learned, one per head (``qk_norm.learnable_logit_scale``)."""
        return self.qk_norm is not None and self.qk_norm.learnable_logit_scale

    @property
    def num_key_scalars(self) -> int:
        """Key scalars cached per token: G (one per KV group), 1 with the projection scope, 0 for
        plain MLA."""
        if not self.has_qk_norm:
            return 0
        return 1 if self.qk_norm.scope == "projection" else self.num_kv_groups

    @property
    def scale(self) -> float:
        """tau: the logit scale (initial value when learnable).

        Default: (d_n + d_r) ** -0.5, times mscale(s, mscale_all_dim)² under DeepSeek YaRN
        (MATH.md "RoPE and YaRN"), as HF's DeepseekV2/V3Attention set ``self.scaling``.
        """
        if self.softmax_scale is not None:
            return self.softmax_scale
        tau = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None:
            tau *= self.rope_scaling.softmax_scale_factor
        return tau

    def replace(self, **changes) -> "MLAConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class AttentionConfig:
    """MHA / GQA / MQA with optional per-head QK norm (Qwen3 / OLMo 2 placement).

    ``num_kv_heads == num_heads`` is MHA, ``1`` is MQA, anything between is GQA.
    ``qk_norm`` is a :class:`QKNormConfig` (or its shorthand) as in :class:`MLAConfig`, None by
    default; the norm is applied per head after the projections and before RoPE, over the whole
    head (no content and RoPE blocks, so its mode is "blockwise" and its scope "head"), with
    weights shared across heads.
    """

    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: Optional[int] = None
    rope_theta: float = 10000.0
    rope_interleave: bool = False
    qk_norm: Optional[QKNormConfig] = None
    softmax_scale: Optional[float] = None

    def __post_init__(self) -> None:
        python_numbers(self)  # np.int64(2) is the int 2 (utils.checked)
        for name in ("hidden_size", "num_heads", "num_kv_heads"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("head_dim", self.head_dim, allow_none=True)
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"head_dim: None needs num_heads={self.num_heads} to divide hidden_size={self.hidden_size}; "
                "pass head_dim explicitly"
            )
        check_groups("num_kv_heads", self.num_kv_heads, self.num_heads)
        check_rope("head_dim", self.dim_per_head, self.rope_theta)
        check_bool("rope_interleave", self.rope_interleave)
        object.__setattr__(self, "qk_norm", QKNormConfig.of(self.qk_norm))
        if self.qk_norm is not None and (self.qk_norm.mode, self.qk_norm.scope) != ("blockwise", "head"):
            raise ValueError(f"qk_norm: a head without content and RoPE blocks takes mode='blockwise' and "
                             f"scope='head', got mode={self.qk_norm.mode!r}, scope={self.qk_norm.scope!r}")
        check_softmax_scale(self.softmax_scale)

    has_qk_norm = MLAConfig.has_qk_norm
    learnable_logit_scale = MLAConfig.learnable_logit_scale

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.dim_per_head ** -0.5

    def replace(self, **changes) -> "AttentionConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SharedKVConfig:
    """DeepSeek-V4's attention without its sequence compression: one shared key = value vector
    per token (MQA), QK-normed by construction (MATH.md, "Shared-KV attention (DeepSeek-V4)").

    Per token and head, with d = ``hidden_size``, h = ``num_heads``, D = ``head_dim``, d_r =
    ``rope_head_dim`` and d_cq = ``q_lora_rank``::

        q_h = RMS(W_UQ RMSNorm_w(W_DQ x))_h     per-head RMS norm without a weight, [D]
        c   = RMSNorm_w(W_KV x)                  the shared key = value, [D], cached
        RoPE on the last d_r dims of q_h and c; o_h = softmax(tau q_h . c_s, sink_h) c_s;
        the last d_r dims of o_h rotated back to position 0 at the query's position; W_O.

    The cache holds c alone: D floats per token and layer (MLA holds d_c + d_r, + G scalars
    with a QK norm). Follows transformers' ``DeepseekV4Attention`` (5.24) on its sliding-window
    layers; its compressor, indexer, sliding window and grouped low-rank output projection are
    not here (a plain ``o_proj``).

    Args:
        head_dim: D, the width of every query head, of the shared vector and of a cache row.
        rope_head_dim: d_r, the trailing dims RoPE rotates (even, at most D).
        q_lora_rank: d_cq of the query's down-projection (with its weighted RMSNorm, as V4);
            None for a direct ``q_proj``.
        attention_sinks: one learned logit per head (initialized to 0) in the softmax's
            denominator, as V4 and gpt-oss.
        softmax_scale: tau; None means D ** -0.5 (V4's).
        norm_eps: eps of the three RMS norms (V4: 1e-6).
    """

    hidden_size: int = 64
    num_heads: int = 4
    head_dim: int = 32
    rope_head_dim: int = 8
    q_lora_rank: Optional[int] = 16
    attention_sinks: bool = True
    rope_theta: float = 10000.0
    softmax_scale: Optional[float] = None
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        python_numbers(self)  # np.int64(2) is the int 2 (utils.checked)
        for name in ("hidden_size", "num_heads", "head_dim", "rope_head_dim"):
            check_positive_int(name, getattr(self, name))
        check_positive_int("q_lora_rank", self.q_lora_rank, allow_none=True)
        check_rope("rope_head_dim", self.rope_head_dim, self.rope_theta)
        if self.rope_head_dim > self.head_dim:
            raise ValueError(f"rope_head_dim: RoPE rotates the last dims of a head, so at most "
                             f"head_dim={self.head_dim}, got {self.rope_head_dim}")
        check_bool("attention_sinks", self.attention_sinks)
        check_softmax_scale(self.softmax_scale)
        check_eps("norm_eps", self.norm_eps)

    has_qk_norm = True  # the norms are the design, not an option
    learnable_logit_scale = False

    @property
    def nope_head_dim(self) -> int:
        """D - d_r, the dims RoPE leaves alone."""
        return self.head_dim - self.rope_head_dim

    @property
    def cache_floats_per_token(self) -> int:
        """Values one token leaves in one layer's cache: the shared vector, D."""
        return self.head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim ** -0.5

    def replace(self, **changes) -> "SharedKVConfig":
        return dataclasses.replace(self, **changes)


# DeepSeek-V2-Lite and V3 values from their published configs. "deepseek-v3-tp8" is the
# local view of one GPU at tensor parallelism 8: 16 of the 128 heads (and KV groups).
MLA_PRESETS: dict[str, MLAConfig] = {
    "tiny": MLAConfig(),
    "deepseek-v2-lite": MLAConfig(
        hidden_size=2048, num_heads=16, num_kv_groups=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
    "deepseek-v2": MLAConfig(
        hidden_size=5120, num_heads=128, num_kv_groups=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
    "deepseek-v3": MLAConfig(
        hidden_size=7168, num_heads=128, num_kv_groups=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
    "deepseek-v3-tp8": MLAConfig(
        hidden_size=7168, num_heads=16, num_kv_groups=16, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
}

# Number of layers of each preset's full model, for per-request cache sizes.
PRESET_NUM_LAYERS: dict[str, int] = {
    "tiny": 2, "deepseek-v2-lite": 27, "deepseek-v2": 60, "deepseek-v3": 61, "deepseek-v3-tp8": 61,
}


def mla_preset(name: str, **overrides) -> MLAConfig:
    """The named :class:`MLAConfig`, with any field overridden."""
    if not isinstance(name, str) or name not in MLA_PRESETS:  # ["tiny"] failed as "unhashable type: 'list'"
        raise ValueError(f"preset: expected one of {sorted(MLA_PRESETS)}, got {name!r}")
    return MLA_PRESETS[name].replace(**overrides) if overrides else MLA_PRESETS[name]
