"""Rotary position embedding (Su et al.), in DeepSeek's interleaved or the NeoX half layout,
with optional YaRN scaling as DeepSeek-V2/V3 and Hugging Face transformers define it.

The angle of pair k at position t is t * w_k, with w_k = theta ** (-2k / dim) for plain RoPE.
Interleaved rotates pairs (x0, x1), (x2, x3), ... as DeepSeek-V2/V3 checkpoints expect; the half
layout rotates (x_k, x_{k + dim/2}) as Llama/NeoX do. The rotation is computed in at least
float32, the frequencies in float64.

YaRN (Peng et al., arXiv 2309.00071; MATH.md "RoPE and YaRN") changes two things here: the
frequencies w_k blend interpolated (w_k / factor) and original ones along a ramp between the
beta_fast and beta_slow rotation counts, and the rotated vectors are multiplied by
``attention_factor`` (HF multiplies its cos/sin tables by it). The third change, the
softmax-scale correction from ``mscale_all_dim``, lives in :attr:`MLAConfig.scale`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Mapping, Optional

import torch
from torch import nn

from .dtypes import accumulate_dtype, cast
from .utils.checked import FixedSettings, as_int, as_number, check_bool, is_finite_number, is_int, python_numbers
from .utils.limits import check_allocation

ROPE_TYPES = ("default", "yarn")
# Keys a Hugging Face / DeepSeek YaRN dict may hold besides our fields ("type" is the
# pre-transformers-4.45 spelling of "rope_type"; rope_theta lives in MLAConfig).
_HF_EXTRA_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's / HF's ``yarn_get_mscale``: 0.1 · mscale · ln(scale) + 1, or 1 for scale <= 1."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


# theta's range: float32's normal numbers. The frequencies theta**(-2k/dim) reach 1/theta, which a subnormal theta
# (1e-300 passed "finite > 0") puts past float32: inf frequencies, NaN angles, without a word.
THETA_RANGE = (2.0 ** -126, float.fromhex("0x1.fffffep+127"))  # torch.finfo(torch.float32) tiny, max


def check_theta(name: str, theta) -> None:
    """A ValueError naming ``name`` unless ``theta`` is a number in :data:`THETA_RANGE` (RoPE's base)."""
    low, high = THETA_RANGE
    if not is_finite_number(theta) or not low <= theta <= high:
        # the bounds as repr, so that typed back they are taken (1.17549e-38 is below 2**-126)
        raise ValueError(f"{name}: expected a finite number > 0 within float32's normal range ({low!r} to {high!r}; "
                         f"RoPE's frequencies theta**(-2k/dim) reach 1/theta), got {theta!r}")


def _number(name: str, value, low: float, allow_none: bool = False, strict: bool = False):
    if value is None and allow_none:
        return
    bad = not is_finite_number(value)
    if bad or value < low or (strict and value == low):
        rel = ">" if strict else ">="
        none = " or None" if allow_none else ""
        raise ValueError(f"{name}: expected a finite number {rel} {low:g}{none}, got {value!r}")


@dataclass(frozen=True)
class YarnScaling:
    """YaRN parameters under their Hugging Face ``rope_parameters`` / DeepSeek ``rope_scaling`` names.

    Args:
        factor: context extension factor s (DeepSeek-V2/V3: 40), >= 1.
        original_max_position_embeddings: the pre-extension context L (DeepSeek: 4096).
        beta_fast, beta_slow: rotation counts bounding the ramp (32 and 1).
        mscale, mscale_all_dim: DeepSeek's temperature coefficients (V3: 1.0 and 1.0; V2: 0.707
            and 0.707). None or 0 means absent, as in HF.
        attention_factor: the cos/sin factor; None derives it from factor, mscale, mscale_all_dim.
        truncate: round the ramp's ends outwards to integers (HF's default, DeepSeek's code).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True

    def __post_init__(self) -> None:
        python_numbers(self)  # np.float32(4.0) is the float 4.0 (utils.checked), as MLAConfig's own fields
        _number("rope_scaling.factor", self.factor, 1.0)
        L = self.original_max_position_embeddings
        if not is_int(L) or not 1 <= L < 2**63:  # 2**70 was taken: no context is that long
            raise ValueError(f"rope_scaling.original_max_position_embeddings: expected a positive int below 2**63, "
                             f"got {L!r}")
        _number("rope_scaling.beta_slow", self.beta_slow, 0.0, strict=True)
        _number("rope_scaling.beta_fast", self.beta_fast, self.beta_slow)
        _number("rope_scaling.mscale", self.mscale, 0.0, allow_none=True)
        _number("rope_scaling.mscale_all_dim", self.mscale_all_dim, 0.0, allow_none=True)
        _number("rope_scaling.attention_factor", self.attention_factor, 0.0, allow_none=True, strict=True)
        check_bool("rope_scaling.truncate", self.truncate)
        self._check_factors()

    def _check_factors(self) -> None:
        """The two factors the fields make, within float32's normal range (:data:`THETA_RANGE`'s bounds), naming
        the field that made them: mscale_all_dim=1e30 gave a softmax scale of 2.8e58 (inf logits), attention_factor
        1e300 failed in the rotation ("value cannot be converted to type float without overflow") and 1e-300
        rotated every vector to 0, mscale=1e300 beside mscale_all_dim failed in math with a bare OverflowError."""
        low, high = THETA_RANGE
        if self.attention_factor is not None:
            cos_sin = "attention_factor"
        else:
            cos_sin = "mscale" if (self.mscale or 0) >= (self.mscale_all_dim or 0) else "mscale_all_dim"
        for name, what, factor in ((cos_sin, "cos/sin factor", lambda: self.cos_sin_factor),
                                   ("mscale_all_dim", "softmax-scale factor", lambda: self.softmax_scale_factor)):
            try:
                value = factor()
            except OverflowError:
                value = math.inf
            if not low <= value <= high:
                raise ValueError(f"rope_scaling.{name}: makes YaRN's {what} {value:g}, outside float32's normal range "
                                 f"({low!r} to {high!r}); got {name}={getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, params: Mapping, name: str = "rope_scaling") -> "YarnScaling":
        """From an HF / DeepSeek dict such as ``{"type": "yarn", "factor": 40, "mscale": 1.0, ...}``.

        Raises:
            ValueError (naming ``name``): a rope type other than "yarn", an unknown key, a missing
            factor or original_max_position_embeddings, or a partial_rotary_factor other than 1.
        """
        rope_type = params.get("rope_type", params.get("type", "yarn"))
        if rope_type != "yarn":
            raise ValueError(f"{name}: rope_type {rope_type!r} is not supported here; allowed: 'yarn' "
                             f"(or no scaling, rope_type 'default')")
        ours = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - ours - set(_HF_EXTRA_KEYS))
        if unknown:
            raise ValueError(f"{name}: unknown YaRN keys {unknown}; allowed: {sorted(ours | set(_HF_EXTRA_KEYS))}")
        if (params.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(f"{name}: partial_rotary_factor must be 1 (DeepSeek rotates all of qk_rope_head_dim), "
                             f"got {params['partial_rotary_factor']!r}")
        for key in ("factor", "original_max_position_embeddings"):
            if params.get(key) is None:
                raise ValueError(f"{name}: YaRN needs {key!r}, got {dict(params)!r}")
        # HF reads beta_fast / beta_slow as `value or default`, so None and 0 mean the default.
        kw = {k: params[k] for k in ours if params.get(k) is not None and k not in ("beta_fast", "beta_slow")}
        kw.update(beta_fast=params.get("beta_fast") or 32.0, beta_slow=params.get("beta_slow") or 1.0)
        L = kw["original_max_position_embeddings"]
        if isinstance(L, float) and L.is_integer():  # JSON configs may spell 4096 as 4096.0
            kw["original_max_position_embeddings"] = int(L)
        return cls(**kw)

    @property
    def cos_sin_factor(self) -> float:
        """m_rope: the factor on the cos/sin tables (HF's ``attention_factor``).

        mscale and mscale_all_dim both set: mscale(s, mscale) / mscale(s, mscale_all_dim)
        (DeepSeek-V2/V3: 1, the two are equal); otherwise 0.1 ln(s) + 1 (plain YaRN).
        """
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """m_tau: DeepSeek's factor on tau, mscale(s, mscale_all_dim)²; 1 without mscale_all_dim.

        (HF's ``yarn_apply_mscale``; DeepSeek-V3 at s = 40: (0.1 ln 40 + 1)² = 1.8739.)
        """
        if not self.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """The YaRN frequencies w_k, k < dim/2, in float64 [dim/2] (HF's ``_compute_yarn_parameters``).

        Pair k completes L·w_k / 2π rotations over the original context L. Pairs with more
        than beta_fast rotations keep w_k (extrapolate), pairs with fewer than beta_slow use
        w_k / s (interpolate); a linear ramp over k blends the two in between.
        """
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim)
        L = self.original_max_position_embeddings

        def correction_dim(rotations: float) -> float:  # the k at which pair k turns `rotations` times
            return dim * math.log(L / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # HF's guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp  # 1: keep the original frequency
        return (1 / (self.factor * base)) * (1 - extrapolate) + (1 / base) * extrapolate


def rope_scaling_from(value, name: str = "rope_scaling") -> Optional[YarnScaling]:
    """None (plain RoPE), a :class:`YarnScaling`, or one from an HF dict (rope_type "default" means None)."""
    if value is None or isinstance(value, YarnScaling):
        return value
    if isinstance(value, Mapping):
        rope_type = value.get("rope_type", value.get("type", "yarn"))
        if rope_type == "default":
            return None
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{name}: rope_type {rope_type!r} is not supported; allowed: {ROPE_TYPES}")
        return YarnScaling.from_dict(value, name)
    raise ValueError(f"{name}: expected None, a YarnScaling or a dict with rope_type in {ROPE_TYPES}, "
                     f"got {type(value).__name__}")


def exact_positions(dtype: torch.dtype) -> int:
    """The largest |position| the rotation of x of ``dtype`` takes exactly: positions are cast to the rotation's
    dtype (at least float32, :func:`~qkmla.dtypes.accumulate_dtype`), whose integers are exact up to 2**(mantissa
    bits + 1) only, 2**24 in float32. Past it t was rounded before t * w_k: 2**24 + 1 was rotated as 2**24, an
    error of 0.70 on a unit vector, without a word. The angles are not computed in float64 instead: that would
    change the bits of every position below it, which trained models depend on."""
    return round(2 / torch.finfo(accumulate_dtype(dtype)).eps)  # eps = 2**-(mantissa bits)


def position_range(positions: torch.Tensor) -> tuple[int, int]:
    """(min, max) of integer ``positions`` as Python ints, in one read. uint16/32/64 are read as int64 (aminmax
    has no kernel for them: "aminmax_cpu not implemented for 'UInt32'", naming no argument)."""
    if positions.dtype == torch.uint64:  # past 2**63 .long() wraps to negatives: read the sign bit as "past"
        positions = positions.view(torch.int64)
        if bool((positions < 0).any()):
            return 0, 2 ** 64 - 1
    elif positions.dtype in (torch.uint16, torch.uint32):
        positions = positions.long()
    low, high = torch.stack(torch.aminmax(positions)).tolist()
    return low, high


def check_position_range(name: str, low: int, high: int, dtype: torch.dtype) -> None:
    """A ValueError naming ``name`` unless every position in [low, high] is within :func:`exact_positions`."""
    limit = exact_positions(dtype)
    if low < -limit or high > limit:
        bad = high if high > limit else low
        raise ValueError(f"{name}: expected positions within +-{limit} (2**{limit.bit_length() - 1}: the "
                         f"{accumulate_dtype(dtype)} RoPE angles hold integers exactly up to it), got {bad}; rotate "
                         f"float64 x with a float64 module (.double()) for positions past it")


def check_positions(positions, x: torch.Tensor) -> None:
    """A ValueError naming ``positions`` unless it is a real tensor [..., T] that broadcasts to x's [..., T]
    (x [..., T, H, dim]) without growing it: a list failed in ``.to`` ("'list' object has no attribute 'to'"),
    and positions of another length in the broadcast ("The size of tensor a (3) must match ...")."""
    # A floating-point tensor too: positions [0.5, 1.0, 2.0] rotated by fractions of a position, without a word
    if not isinstance(positions, torch.Tensor) or positions.dtype == torch.bool or positions.is_complex() \
            or positions.is_floating_point():
        got = f"a {positions.dtype} tensor" if isinstance(positions, torch.Tensor) else f"{positions!r:.80}"
        raise ValueError(f"positions: expected an integer tensor [..., T] (x is {tuple(x.shape)}), got {got}")
    if positions.device != x.device:  # failed in the product with the frequencies, naming neither
        raise ValueError(f"positions: x is on {x.device} and positions on {positions.device}; pass "
                         f"positions.to({str(x.device)!r})")
    tokens = tuple(x.shape[:-2])
    try:
        fits = torch.broadcast_shapes(tuple(positions.shape), tokens) == tokens
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"positions: expected a shape that broadcasts to x's tokens {tokens} (x [..., T, H, dim] is "
                         f"{tuple(x.shape)}), got {tuple(positions.shape)}")
    # Their range, where reading it is free (CPU positions, outside compilation; the attention layers check theirs
    # on every device in default_positions, where they already read them): past exact_positions they were rounded.
    if positions.device.type == "cpu" and positions.numel() and not torch.compiler.is_compiling():
        low, high = position_range(positions)
        check_position_range("positions", low, high, x.dtype)


class RotaryEmbedding(FixedSettings, nn.Module):
    """Applies RoPE to x [..., T, H, dim] at integer positions [..., T].

    Args:
        dim: rotated width (even).
        theta: base of the frequencies.
        interleave: True for pairs (x0, x1), False for halves.
        scaling: None for plain RoPE, or a :class:`YarnScaling`.
    """

    # Fixed once made (set or deleted later: AttributeError): the frequencies are computed from them
    # here, so theta or dim set later changed nothing but the repr, and interleave set later ("no",
    # truthy) rotated another layout.
    fixed_settings = ("dim", "theta", "interleave", "scaling")

    def __init__(self, dim: int, theta: float = 10000.0, interleave: bool = True,
                 scaling: Optional[YarnScaling] = None):
        super().__init__()
        # Checked as MLAConfig checks its RoPE: dim=0 built an empty module, dim=-2 failed in torch.arange,
        # theta=0 or -5 made inf/NaN frequencies without a word, scaling={...} failed as a dict's attribute.
        dim = as_int(dim)  # a NumPy int is a width (np.int64(16) was refused as "got np.int64(16)")
        if not is_int(dim) or dim < 2 or dim % 2:
            raise ValueError(f"dim: expected a positive even int (RoPE rotates pairs), got {dim!r}")
        # Sized against the machine before torch's allocator is asked: dim=2**40 failed in torch.arange with
        # "DefaultCPUAllocator: can't allocate memory", naming no argument (the float64 frequencies: 4 bytes a dim)
        check_allocation("dim", 4 * dim, f"the {dim // 2} float64 RoPE frequencies of dim={dim}")
        theta = as_number(theta)  # np.float32(500.0) is a base, too
        check_theta("theta", theta)
        check_bool("interleave", interleave)  # True: pairs (x0, x1); False: halves
        if scaling is not None and not isinstance(scaling, YarnScaling):
            raise ValueError(f"scaling: expected None or a YarnScaling (rope_scaling_from converts an HF dict), "
                             f"got {scaling!r:.80}")
        self.dim, self.theta, self.interleave, self.scaling = dim, float(theta), interleave, scaling
        if scaling is None:
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
            self.attention_factor = 1.0
        else:
            inv_freq = scaling.inv_freq(dim, self.theta)
            self.attention_factor = scaling.cos_sin_factor
        # The buffer follows the module's device and dtype, but never below float32: _apply
        # rebuilds it from this float64 copy, so .to(torch.bfloat16) does not round the
        # frequencies to 3 digits and a float64 module gets them exact, whatever came before.
        # The float64 copy is made on the CPU even under a meta-device context (transformers'
        # from_pretrained builds the model there), so it is always there to rebuild from.
        self._inv_freq64 = inv_freq
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._inv_freq_made = self.inv_freq

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq64.to(self.inv_freq.device, accumulate_dtype(self.inv_freq.dtype))
        self._inv_freq_made = self.inv_freq
        return self

    def frequencies(self) -> torch.Tensor:
        """The buffer ``inv_freq`` [dim/2], rebuilt from the float64 copy if something outside this
        module replaced it (transformers' loader, after a meta-device init, puts an uninitialised
        placeholder in every non-persistent buffer and re-initialises only its own)."""
        if self.inv_freq is not self._inv_freq_made:
            device = self.inv_freq.device if not self.inv_freq.is_meta else self._inv_freq64.device
            self.inv_freq = self._inv_freq64.to(device, accumulate_dtype(self.inv_freq.dtype))
            self._inv_freq_made = self.inv_freq
        return self.inv_freq

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._rotate(x, positions, self.attention_factor)

    def shift(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Move vectors x [..., T, H, dim] that this module already rotated by ``offsets``
        [..., T] positions (negative: earlier): RoPE_{p + o}(v) = R(o w) RoPE_p(v), a pure
        rotation, because YaRN's factor m was applied once, at p. Rounding aside, equal to
        rotating the unrotated v to p + o directly."""
        return self._rotate(x, offsets, 1.0)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, m: float) -> torch.Tensor:
        """x rotated by the angles of ``positions`` and multiplied by m."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.dim:
            # x of another width failed in the broadcast below ("The size of tensor a (3) must match ...")
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else f"{x!r:.80}"
            raise ValueError(f"x: expected a tensor [..., T, H, dim={self.dim}] (this module's dim), got {got}")
        if not x.is_floating_point():  # int64 x came back rotated and truncated to integers, without a word
            raise ValueError(f"x: expected a floating-point tensor (the output has x's dtype), got {x.dtype}")
        check_positions(positions, x)
        freqs = self.frequencies()
        if freqs.device != x.device:
            # A meta x (a model built under torch.device("meta"), run for its shapes) gets meta frequencies: the
            # float64 copy stays on the CPU there (see __init__). On any other device, x of another device than
            # the module's failed in the product below, "Tensor on device cpu is not on the expected device meta!"
            if not x.is_meta:
                raise ValueError(f"x: the module's frequencies are on {freqs.device} and x is on {x.device}; move the "
                                 f"module (module.to({str(x.device)!r})) or x")
            freqs = freqs.to(x.device)
        acc = accumulate_dtype(x.dtype)
        angles = positions.to(acc)[..., None, None] * cast(freqs, acc)  # [..., T, 1, dim/2]
        xa = cast(x, acc)
        if self.interleave:
            # Pairs (x0, x1) as complex numbers x0 + i x1, rotated by m e^(i angle): one complex
            # product in place of a dozen real ops (DeepSeek's reference code does the same).
            pairs = torch.view_as_complex(xa.unflatten(-1, (-1, 2)).contiguous())
            rot = torch.polar(torch.ones_like(angles) if m == 1.0 else torch.full_like(angles, m), angles)
            return cast(torch.view_as_real(pairs * rot).flatten(-2), x.dtype)
        cos, sin = angles.cos(), angles.sin()
        if m != 1.0:
            cos, sin = cos * m, sin * m
        x1, x2 = xa.chunk(2, dim=-1)
        return cast(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1), x.dtype)

    def extra_repr(self) -> str:
        yarn = "" if self.scaling is None else f", yarn(factor={self.scaling.factor:g}, m={self.attention_factor:.6g})"
        return f"{self.dim}, theta={self.theta:g}, interleave={self.interleave}{yarn}"
