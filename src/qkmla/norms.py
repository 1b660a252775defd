"""The scalar-statistic normalization family: gamma ⊙ v · sigma(v), and the QK norm built from it.

Every member is a static weight gamma and one dynamic scalar sigma(v) per vector (MATH.md, "Any
scalar-statistic norm absorbs"); the statistics (rms, l2, lp) and their moments are in
``qkmla.ops.statistic``, below the fused ops that compute them too. :class:`QKNorm` normalizes a
query or key split into its content and RoPE blocks (blockwise, unified or content mode).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import QK_NORM_MODES, QK_NORM_SCOPES, QK_NORMS, QKNormConfig, check_positive_int
from .dtypes import accumulate_dtype, cast
from .ops.statistic import Moment, moment, statistic_from_moment
from .utils.checked import as_int
from .utils.limits import check_allocation


class ScalarNorm(nn.Module):
    """gamma ⊙ v · sigma(v) over the last dim, gamma initialized to ones.

    Args:
        dim: n, the normalized width.
        kind: "rms", "l2" or "lp".
        p: the p of "lp".
        eps: eps inside the statistic.
        heads: None: one weight [n] for every vector; an int H: one row per head, weight [H, n],
            for inputs [..., H, n] (a norm over a whole projection has a weight per channel).
    """

    def __init__(self, dim: int, kind: str = "rms", p: float = 2.0, eps: float = 1e-6, heads: Optional[int] = None):
        super().__init__()
        if kind not in QK_NORMS[1:]:
            raise ValueError(f"kind: expected one of {QK_NORMS[1:]}, got {kind!r}")
        # The module is public (qkmla.ScalarNorm): its numbers get the checks a QKNormConfig's get,
        # by the same code, so eps=-1 or p=0.5 is refused here as it is there.
        QKNormConfig(kind=kind, p=p, eps=eps)
        dim, heads = as_int(dim), as_int(heads)  # a NumPy int is a width (np.int64(8): "expected a positive int")
        check_positive_int("dim", dim)
        check_positive_int("heads", heads, allow_none=True)
        # Sized against the machine before torch's allocator is asked (heads=2**40 reached it).
        check_allocation("heads" if heads is not None else "dim", 4 * dim * (heads or 1),
                         f"a norm weight of {heads or 1} x {dim} float32 values")
        self._fixed = (dim, kind, float(p), float(eps))
        self.weight = nn.Parameter(torch.ones(dim) if heads is None else torch.ones(heads, dim))

    # Read-only: the statistic is part of the layer's function (and of the absorbed weights
    # derived from it); another one is another module, not a setting.
    dim = property(lambda self: self._fixed[0])
    kind = property(lambda self: self._fixed[1])
    p = property(lambda self: self._fixed[2])
    eps = property(lambda self: self._fixed[3])

    def check_input(self, v, weight: Optional[torch.Tensor] = None, name: str = "v",
                    weight_name: str = "weight") -> None:
        """v [..., dim] floating point, and a replacement weight that broadcasts against it; ``name``,
        ``weight_name``: theirs for the caller (QKNorm's v_c, v_r, content_weight)."""
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[-1] != self.dim:
            # a width other than dim failed in the weight's broadcast ("The size of tensor a (5) must match
            # the size of tensor b (8)"), naming neither the argument nor the width the norm was built for
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"{name}: expected a tensor [..., dim={self.dim}], got {got}")
        if not v.is_floating_point():  # an integer tensor came back cast to its dtype: norm(ones) was all zeros
            raise ValueError(f"{name}: expected a floating-point tensor (the output has its dtype), got {v.dtype}")
        if weight is not None:
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
            got = shape if shape is not None else type(weight).__name__
            try:
                fits = shape is not None and shape[-1:] == (self.dim,) and \
                    torch.broadcast_shapes(shape, v.shape) == v.shape
            except RuntimeError:
                fits = False
            if not fits:
                raise ValueError(f"{weight_name}: expected a tensor [..., dim={self.dim}] that broadcasts against "
                                 f"{name} {tuple(v.shape)}, got {got}")
            if weight.device != v.device:
                raise ValueError(f"{weight_name}: {name} is on {v.device} and {weight_name} on {weight.device}; pass "
                                 f"{weight_name}.to({str(v.device)!r})")
        elif self.weight.device != v.device:  # failed in the product, "Tensor on device cpu is not on ... meta!"
            raise ValueError(f"{name}: the norm's weight is on {self.weight.device} and {name} on {v.device}; pass "
                             f"{name}.to({str(self.weight.device)!r}) or move the module")

    def statistic(self, v: torch.Tensor) -> torch.Tensor:
        return statistic_from_moment(moment(v, self.kind, self.p, self.eps), v.shape[-1], self.kind, self.p, self.eps)

    def scaled(self, v: torch.Tensor, sigma: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """gamma ⊙ v · sigma, given sigma (so callers can reuse or replace the statistic).

        ``weight`` replaces gamma (the absorbed query passes gamma_q ⊙ gamma_k).
        """
        self.check_input(v, weight)  # here, not in forward only: QKNorm's unified and content modes come here
        weight = self.weight if weight is None else weight
        acc = accumulate_dtype(v.dtype)
        return cast(cast(v, acc) * sigma * cast(weight, acc), v.dtype)

    def forward(self, v: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """gamma ⊙ v · sigma(v); ``weight`` replaces gamma: [n], or one row per vector
        (any shape that broadcasts against v, e.g. [H, n] for v [B, T, H, n])."""
        self.check_input(v, weight)
        weight = self.weight if weight is None else weight
        # The same arithmetic, one fused kernel; not at eps = 0, whose zero vector it makes NaN (statistic.moment).
        # Through rms_norm: F.rms_norm alone zeroed a vector near 1e19 in float32, as the statistic here does not.
        if self.kind == "rms" and v.is_cuda and self.eps > 0:
            if weight.dim() == 1:
                return rms_norm(v, cast(weight, v.dtype), self.eps)
            return rms_norm(v, None, self.eps) * cast(weight, v.dtype)
        return self.scaled(v, self.statistic(v), weight)

    def extra_repr(self) -> str:
        p = f", p={self.p:g}" if self.kind == "lp" else ""
        heads = f", heads={self.weight.shape[0]}" if self.weight.dim() == 2 else ""
        return f"{self.dim}, kind={self.kind}{p}, eps={self.eps:g}{heads}"


# A vector whose sum of squares would overflow is first scaled by a power of two to max|v| in [2**39, 2**40):
# its squares then sum far below the dtype's largest (n < 2**46 values in float32), and eps next to them is
# below rounding, so the result is the exact one.
RESCALED_EXPONENT = 40


def rms_norm(v: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: Optional[float] = None) -> torch.Tensor:
    """``F.rms_norm`` over the last dim of v [..., n] (weight [n] or None), bit for bit (output and gradients)
    wherever no rescale is taken; a vector whose sum of squares could leave v's accumulation dtype (float32 for
    float32, bfloat16 and float16; the test keeps a margin, so from max|v| of 2^59 in float32 at n = 1536) is
    rescaled first. There F.rms_norm's statistic was inf and the vector came back as zeros (|v| near 1e19 in
    float32: 2.47 off the float64 answer); in the margin below that, the output is the same and the gradient is
    not bit for bit F.rms_norm's but closer to float64's (2.0e-23 against 2.0e-18 at |g| near 1e-16, the review of
    r23-api). The rescale is exact: RMSNorm does not change under v -> 2^k v but for eps (see RESCALED_EXPONENT),
    and :func:`~qkmla.ops.statistic.moment` rescales the QK norms' statistic the same way. With eps = 0, vectors
    whose squares fall below the normal numbers are rescaled too (a zero vector stays F.rms_norm's NaN, which
    MLA's padding masks)."""
    acc = accumulate_dtype(v.dtype)
    info = torch.finfo(acc)
    largest = cast(v.detach().abs().amax(-1, keepdim=True), acc)
    _, e = torch.frexp(largest)  # max|v| = m 2^e, m in [0.5, 1)
    outside = 2 * e > math.log2(info.max) - 1 - math.log2(v.shape[-1])
    shift = torch.where(outside, e - RESCALED_EXPONENT, 0)
    if eps == 0:  # nothing added: squares below the normal numbers lost their precision (|v| of 1e-25 gave inf)
        low = (2 * (e - 1) < math.log2(info.tiny) - math.log2(info.eps)) & (largest >= info.tiny)
        shift = torch.where(low, e, shift)  # max|v| to [0.5, 1): 2^-e is at most 2^125, within range
    return F.rms_norm(v * cast(torch.exp2(-shift.to(acc)), v.dtype), (v.shape[-1],), weight, eps)  # 1 inside


class LatentRMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` over one dim (its parameter, its state dict) through :func:`rms_norm`, so a vector past
    float32's squares is normalized rather than zeroed: MLA's latent norms (``q_a_layernorm``, ``kv_a_layernorm``)
    and DeepSeek-V4's. Its eps is the config's (``latent_norm_eps``, ``norm_eps``) and read-only: set on the built
    module (``kv_a_layernorm.eps = 10``) the layer computed with it while its config said 1e-6 (0.80 off the
    layer rebuilt from that config), without a word."""

    def __init__(self, normalized_shape: int, eps: Optional[float] = None, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"normalized_shape: expected one dim, got {self.normalized_shape}")

    @property
    def eps(self) -> Optional[float]:
        return self.__dict__["eps"]

    @eps.setter
    def eps(self, value) -> None:
        if "eps" in self.__dict__:  # set once, by nn.RMSNorm.__init__ (its extra_repr reads it there)
            raise AttributeError("eps: fixed when the norm is built (its layer's config holds it); build the layer "
                                 "from config.replace(latent_norm_eps=...) (MLA) or norm_eps (shared-KV)")
        self.__dict__["eps"] = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RecordsVariant:
    """Mixin: the state dict records which norm made it (``variant()``, as ASCII bytes under
    ``_extra_state``, so safetensors holds it), and loading a state recorded by another
    variant is refused. Shapes alone cannot tell RMS from L2 or blockwise from unified, and
    the same weights mean a different function under each. A state without the record
    (saved before it existed, or by another library) loads as it always did."""

    def variant(self) -> str:
        raise NotImplementedError

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(list(self.variant().encode()), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:  # checked in _load_from_state_dict, which knows the key
        pass

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "_extra_state"
        if key in state_dict:
            saved = state_dict[key]
            saved = bytes(saved.tolist()).decode("ascii", "replace") if isinstance(saved, torch.Tensor) else str(saved)
            if saved != self.variant():
                raise ValueError(f"state_dict: {key} says these weights belong to a {saved} QK norm, but this "
                                 f"module's is {self.variant()}; build the module with the config they were "
                                 f"saved with")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if key in missing_keys:
            missing_keys.remove(key)


class HeadNorm(RecordsVariant, ScalarNorm):
    """A :class:`ScalarNorm` that records its kind (and p) in the state dict: the per-head QK
    norm of ``MultiHeadAttention``."""

    def variant(self) -> str:
        return f"{self.kind}" + (f"(p={self.p:g})" if self.kind == "lp" else "")


class QKNorm(RecordsVariant, nn.Module):
    """Normalizes one head's query or key split into a content block and a RoPE block.

    ``blockwise``: each block has its own statistic (MATH.md default).
    ``unified``: one statistic over the concatenation; the weights are still stored per
    block (their concatenation is the unified weight), so the modes share parameter names.
    ``content``: one statistic from the content block alone, applied to both blocks.

    Inputs broadcast against each other in unified mode: a key's content block
    [B, T, G, d_n] and its shared RoPE block [B, T, 1, d_r] give a statistic [B, T, G, 1].

    ``scope="projection"`` pools the moments over the heads axis (dim -2, after broadcasting the
    two blocks: a shared RoPE key counts once per group) before the statistic, so every head of
    a token shares one statistic [..., 1, 1] (MATH.md, "Statistic scope"); the weights then have
    a row per head: ``heads`` rows for the content block, ``rope_heads`` (None: one shared row)
    for the RoPE block.

    ``scalar_norm``: the class of the two block norms (a host library's module base, as torchtitan's
    integration sets it; the math stays :class:`ScalarNorm`'s).
    """

    scalar_norm = ScalarNorm

    def __init__(self, content_dim: int, rope_dim: int, kind: str = "rms", p: float = 2.0,
                 eps: float = 1e-6, mode: str = "blockwise", scope: str = "head", heads: Optional[int] = None,
                 rope_heads: Optional[int] = None):
        super().__init__()
        if mode not in QK_NORM_MODES:
            raise ValueError(f"mode: expected one of {QK_NORM_MODES}, got {mode!r}")
        if scope not in QK_NORM_SCOPES:
            raise ValueError(f"scope: expected one of {QK_NORM_SCOPES}, got {scope!r}")
        # a NumPy int is a width, as for ScalarNorm and the caches ("expected a positive int, got np.int64(8)")
        content_dim, rope_dim, heads, rope_heads = (as_int(v) for v in (content_dim, rope_dim, heads, rope_heads))
        check_positive_int("content_dim", content_dim)
        check_positive_int("rope_dim", rope_dim)
        # Checked whatever the scope, which alone reads them: heads=0 was kept without a word.
        check_positive_int("heads", heads, allow_none=True)
        check_positive_int("rope_heads", rope_heads, allow_none=True)
        self._mode, self._scope = mode, scope
        # Named as this constructor's arguments: QKNorm(2**40, 8) was refused as ScalarNorm's "dim: a norm weight of
        # 1 x 1099511627776 float32 values need ...", an argument the caller never passed
        for name, width in (("content_dim", content_dim), ("rope_dim", rope_dim)):
            check_allocation(name, 4 * width, f"a norm weight of {width} float32 values")
        per_head = scope == "projection"
        for name, rows, width in (("heads", heads, content_dim), ("rope_heads", rope_heads, rope_dim)):
            if per_head and rows is not None:  # named as this constructor's argument, before ScalarNorm's check
                check_allocation(name, 4 * rows * width, f"a norm weight of {rows} x {width} float32 values")
        self.content = self.scalar_norm(content_dim, kind, p, eps, heads if per_head else None)
        self.rope = self.scalar_norm(rope_dim, kind, p, eps, rope_heads if per_head else None)

    # Read-only, as the block norms' are: qk.kind = "l2" (or p, eps) set a plain attribute the norm never read, and
    # the module went on normalizing with its own statistic, without a word
    kind = property(lambda self: self.content.kind, doc="'rms', 'l2' or 'lp' (read-only)")
    p = property(lambda self: self.content.p, doc="p of the Lp norm (read-only)")
    eps = property(lambda self: self.content.eps, doc="eps inside the statistic (read-only)")
    mode = property(lambda self: self._mode, doc="'blockwise', 'unified' or 'content' (read-only, as the kind is)")
    scope = property(lambda self: self._scope, doc="'head' or 'projection' (read-only)")

    def variant(self) -> str:
        return QKNormConfig(self.content.kind, self.mode, self.content.p, scope=self.scope).name

    def _statistic(self, m: Moment, n: int) -> torch.Tensor:
        """sigma from a moment m [..., H, 1] of vectors of width n; pooled over the heads axis with
        the projection scope."""
        c = self.content
        if self.scope == "projection":
            heads = m.scaled.shape[-2]
            m, n = m.sum(dim=-2), n * heads
        return statistic_from_moment(m, n, c.kind, c.p, c.eps)

    def statistics(self, v_c: torch.Tensor, v_r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sigma_c, sigma_r), each [..., 1]; the same tensor twice in unified and content modes."""
        c = self.content
        if self.mode != "blockwise" or self.scope == "projection":
            check_blocks_broadcast(v_c, v_r, {"unified": "the unified mode takes one statistic over both blocks",
                                              "content": "the content mode applies v_c's statistic to v_r"}.get(
                self.mode, "the projection scope pools the heads of both blocks"))
        if self.scope == "projection":  # a shared RoPE key is one vector per group
            heads = torch.broadcast_shapes(v_c.shape[:-1], v_r.shape[:-1])
            v_c, v_r = v_c.expand(*heads, v_c.shape[-1]), v_r.expand(*heads, v_r.shape[-1])
        if self.mode == "blockwise":
            return (self._statistic(moment(v_c, c.kind, c.p, c.eps), self.content.dim),
                    self._statistic(moment(v_r, c.kind, c.p, c.eps), self.rope.dim))
        if self.mode == "content":
            sigma = self._statistic(moment(v_c, c.kind, c.p, c.eps), self.content.dim)
            return sigma, sigma
        sigma = self._statistic(moment(v_c, c.kind, c.p, c.eps) + moment(v_r, c.kind, c.p, c.eps),
                                self.content.dim + self.rope.dim)
        return sigma, sigma

    def forward(self, v_c: torch.Tensor, v_r: torch.Tensor,
                content_weight: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gamma^C ⊙ v_c · sigma_c, gamma^R ⊙ v_r · sigma_r); ``content_weight`` replaces gamma^C."""
        # each block named as the caller knows it (a wrong width failed in a broadcast, or as "v")
        self.content.check_input(v_c, content_weight, "v_c", "content_weight")
        self.rope.check_input(v_r, None, "v_r")
        if self.mode == "blockwise" and self.scope == "head":  # each block on its own (fused where the kind allows)
            return self.content(v_c, content_weight), self.rope(v_r)
        sigma_c, sigma_r = self.statistics(v_c, v_r)
        return self.content.scaled(v_c, sigma_c, content_weight), self.rope.scaled(v_r, sigma_r)


def check_blocks_broadcast(v_c: torch.Tensor, v_r: torch.Tensor, why: str) -> None:
    """ValueError naming v_r unless the blocks' vectors v_c [..., d_n] and v_r [..., d_r] broadcast against each
    other, which a statistic read across the blocks (``why``) needs: a batch of 2 against 3 failed in torch's
    broadcast ("The size of tensor a (2) must match the size of tensor b (3)"), naming neither."""
    try:
        torch.broadcast_shapes(v_c.shape[:-1], v_r.shape[:-1])
    except RuntimeError:
        raise ValueError(f"v_r: {why}, so the vectors of v_c and v_r must broadcast against each other; got v_c "
                         f"{tuple(v_c.shape)} and v_r {tuple(v_r.shape)}") from None


def rows_per_head(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A norm weight with a row per KV group [G, n] as a row per head [heads, n] (head i reads group
    i // (heads / G)); a weight shared by the heads [n] as it is."""
    return weight if weight.dim() == 1 else weight.repeat_interleave(heads // weight.shape[0], dim=0)


def make_qk_norms(norm: Optional[QKNormConfig], content_dim: int, rope_dim: int, heads: Optional[int] = None,
                  groups: Optional[int] = None, norm_class: type = None) -> tuple[Optional[QKNorm], Optional[QKNorm]]:
    """(q_norm, k_norm) of a layer with the QK norm ``norm``, or (None, None) without one. With the
    projection scope the query's weights have a row per head (``heads``), the key's content weight
    one per KV group (``groups``) and its RoPE weight one row (MLA's RoPE key is shared by the groups).
    ``norm_class``: a :class:`QKNorm` subclass to build (default :class:`QKNorm`)."""
    if norm is None or norm.kind is None:
        return None, None
    norm_class = norm_class or QKNorm
    args = (content_dim, rope_dim, norm.kind, norm.p, norm.eps, norm.mode, norm.scope)
    return norm_class(*args, heads, heads), norm_class(*args, groups, None)


def qk_norms_of(config) -> tuple[Optional[QKNorm], Optional[QKNorm]]:
    """(q_norm, k_norm) of an :class:`~qkmla.MLAConfig`'s layer (:func:`make_qk_norms`)."""
    c = config
    return make_qk_norms(c.qk_norm, c.qk_nope_head_dim, c.qk_rope_head_dim, c.num_heads, c.num_kv_groups)
