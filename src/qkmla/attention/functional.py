"""Attention arithmetic shared by the modules: SDPA over materialized keys, positions,
max-logit tracking. The absorbed decode attention is the op ``qkmla.ops.mla_decode``.

Shapes follow [B, T, H, D]: B sequences, T query tokens, S cached tokens, h query heads,
G KV groups (head i reads group i // (h / G)).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from ..dtypes import accumulate_dtype
from ..rope import RotaryEmbedding, check_position_range, position_range
from ..utils.checked import check_bool
from .sinks import sink_column

Scale = Union[float, torch.Tensor]  # a float, or one value per head [h]

# SDPA broadcasts KV groups itself from PyTorch 2.5 on; older versions get repeated keys.
_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def check_hidden(x: torch.Tensor, hidden_size: int, dtype: torch.dtype, device: Optional[torch.device] = None) -> None:
    """x must be [B, T, hidden_size] in the module's dtype, and on its ``device`` (its weights')."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor of shape [batch, seq, {hidden_size}], got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != hidden_size or x.shape[1] == 0:
        raise ValueError(f"x: expected shape [batch, seq >= 1, hidden_size={hidden_size}], got {tuple(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"x: dtype {x.dtype} does not match the module's parameters ({dtype}); "
                         f"pass x.to({dtype}) or call module.to(dtype)")
    # x on the meta device given to a CPU module (or a CPU x to a CUDA one) failed in the first projection or
    # RoPE, "Tensor on device cpu is not on the expected device meta!", naming nothing
    if device is not None and (x.device.type != device.type or None not in (x.device.index, device.index)
                               and x.device.index != device.index):
        raise ValueError(f"x: the module's weights are on {device} and x is on {x.device}; pass "
                         f"x.to({str(device)!r}) or call module.to(x.device)")


def check_forward(module, x: torch.Tensor, cache, cache_type: type, input_lengths) -> None:
    """Check ``module(x, cache, input_lengths=...)`` before any work, for an attention module with a
    ``config`` and an ``o_proj``: x [B, T, hidden_size] in the module's dtype; ``cache`` None or a
    ``cache_type`` made for the module's config; ``input_lengths`` [B] only with a cache."""
    c = module.config
    check_hidden(x, c.hidden_size, module.o_proj.weight.dtype, module.o_proj.weight.device)
    if cache is None:
        if input_lengths is not None:
            raise ValueError("input_lengths: only meaningful with a cache (padding is not written)")
        return
    if not isinstance(cache, cache_type):
        raise ValueError(f"cache: expected a {cache_type.__name__} or None, got {type(cache).__name__}")
    cache.check_config(c)
    check_cache_device(cache, x)


def check_cache_device(cache, x: torch.Tensor) -> None:
    """A cache on another device than x (device='meta', or the CPU for a CUDA module) failed inside
    torch's indexing, "Tensor on device cpu is not on the expected device meta!", after the projections
    ran: a ValueError naming cache, before any work. A qkmla cache's ``device`` is where its buffers
    are (``cuda`` resolved to ``cuda:0`` or the current one when it was built); a device without an
    index, another object's, matches every index of its kind."""
    c, d = cache.device, x.device
    if c.type != d.type or (c.index is not None and d.index is not None and c.index != d.index):
        raise ValueError(f"cache: its buffers are on {cache.device} and x is on {x.device}; build the cache with "
                         f"device=x.device (LatentCache.from_config(config, ..., device=...))")


def default_positions(x: torch.Tensor, positions: Optional[torch.Tensor], name: str = "positions",
                      signed: bool = False) -> torch.Tensor:
    """[B, T] positions: 0..T-1 when none are given; a [T] or [1, T] tensor is broadcast.
    ``name``: the argument they came as; ``signed``: negative positions allowed (RoPE is defined
    for them, and a host model's position ids may have them)."""
    B, T = x.shape[:2]
    if positions is None:
        check_position_range("positions", 0, T - 1, x.dtype)  # T past 2**24 (float32): see exact_positions
        return torch.arange(T, device=x.device).expand(B, T)
    if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer tensor of shape [{B}, {T}] or [{T}], got {positions!r:.80}")
    if positions.shape in ((T,), (1, T)):
        positions = positions.expand(B, T)
    if positions.shape != (B, T):
        raise ValueError(f"{name}: expected shape [{B}, {T}] or [{T}], got {tuple(positions.shape)}")
    if positions.numel() and not positions.is_meta and (not signed or positions.device.type == "cpu"):
        # One read of their range, where their sign was read already (unsigned ones, on every device), or where the
        # read is free (the CPU): positions past exact_positions were rotated as rounded ones (2**24 + 1 as 2**24 in
        # float32), without a word. Signed CUDA positions (a host model's, every decode step) are not read here.
        low, high = position_range(positions)
        if not signed and low < 0:
            raise ValueError(f"{name}: expected non-negative positions")
        check_position_range(name, low, high, x.dtype)
    return positions.to(x.device)


def zero_padding(x: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """x [B, T, d] with the right padding (``valid`` [B, T] False) set to 0, or x itself.

    A padded token is never attended to, but its keys and values still enter the attention
    products, where a softmax weight of 0 times a NaN or inf is NaN: zeroed first, the
    padding cannot reach a real token's output, whatever it held.
    """
    return x if valid is None else x.masked_fill(~valid[..., None], 0)


def per_head(scale: Scale, ndim_after: int) -> Scale:
    """Broadcast a per-head scale [h] over ``ndim_after`` trailing dims."""
    if isinstance(scale, torch.Tensor):
        return scale.view(scale.shape + (1,) * ndim_after)
    return scale


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Scale,
         mask: Optional[torch.Tensor] = None, causal: bool = False,
         sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One ``scaled_dot_product_attention`` call over materialized keys.

    Args:
        q: [B, T, h, D]; k: [B, S, G, D]; v: [B, S, G, Dv]; G divides h.
        scale: logit scale, a float or [h] (then folded into q).
        mask: [B, T, S] bool, True where a key is visible; rows with no visible key give 0.
        causal: plain causal masking with T == S (no mask).
        sinks: [h] attention sinks' logits (``sinks.py``: one more key per head, exactly), or None.

    Returns:
        [B, T, h, Dv]
    """
    nan = nan_rows(q, k, scale, mask, causal)
    if sinks is not None:  # a row with no visible key puts all its weight on the sink's zero value
        q, k, v, mask, scale = sink_column(q, k, v, scale, sinks, mask, causal)
        causal = False
    h, G = q.shape[2], k.shape[2]
    if isinstance(scale, torch.Tensor):
        q, scale = q * per_head(scale, 1).to(q.dtype), 1.0
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    kwargs = {}
    if G != h:
        if _SDPA_HAS_GQA:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(h // G, dim=1) for t in (k, v))
    attn_mask = mask[:, None] if mask is not None else None
    # The fused kernels (flash on the CPU and on CUDA) need one head width for q, k and v; without them
    # SDPA stores every score ([B, h, T, S]: 64 GiB at 32k tokens and 16 heads). MLA's are unequal
    # (d_n + d_r against d_v), so the narrower side gets zero columns, which change no dot product.
    D, Dv = q.shape[-1], v.shape[-1]
    if Dv < D:
        v = F.pad(v, (0, D - Dv))
    elif D < Dv:
        q, k = F.pad(q, (0, Dv - D)), F.pad(k, (0, Dv - D))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal and mask is None,
                                         scale=scale, **kwargs)
    out = out[..., :Dv].transpose(1, 2)  # [B, T, h, Dv]
    out = out.masked_fill(nan[..., None], float("nan"))
    if mask is not None:
        out = out.masked_fill(~mask.any(-1)[:, :, None, None], 0.0)
    return out


def nan_rows(q: torch.Tensor, k: torch.Tensor, scale: Scale, mask: Optional[torch.Tensor],
             causal: bool) -> torch.Tensor:
    """[B, T, h]: the rows whose logits hold a NaN, so whose softmax is NaN: a NaN in the query or in its head's
    logit scale, or, without a mask (causal or full), in a key the row sees. The CPU's fused kernel answered 0
    for a row whose every logit was NaN (a NaN in kv_b_proj's weight, or in a learned logit scale: the explicit
    path's output was finite, the absorbed path's NaN or refused). With a mask the keys are not read here (that
    would take a [B, T, S, G] reduction); a row with some finite logits comes back NaN from the kernel itself.

    q: [B, T, h, D]; k: [B, S, G, D]; G divides h; scale: a float or [h]."""
    h, G = q.shape[2], k.shape[2]
    rows = q.isnan().any(-1)
    if isinstance(scale, torch.Tensor):
        rows = rows | scale.isnan()
    elif math.isnan(scale):
        rows = torch.ones_like(rows)
    if mask is None:
        bad = k.isnan().any(-1)  # [B, S, G]
        T, S = q.shape[1], k.shape[1]
        if causal:  # query i sees keys 0..i, as is_causal aligns them (the top-left corner)
            seen = (bad.cumsum(1) > 0)[:, torch.arange(T, device=q.device).clamp(max=S - 1)]
        else:
            seen = bad.any(1, keepdim=True).expand(-1, T, -1)
        rows = rows | seen.repeat_interleave(h // G, dim=-1)
    return rows


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, scale: Scale, chunk: int = 256,
               allowed: Optional[Callable] = None) -> torch.Tensor:
    """Per-head max causal pre-softmax logit [h], in chunks of ``chunk`` queries.

    Never holds more than [B, h, chunk, S] logits at once, so measuring does not
    materialize the full attention matrix.

    Args:
        q: [B, T, h, D]; k: [B, T, G, D] (keys of the same T tokens, causal); scale: float or [h].
        allowed: None (causal), or a function of (batch [B, 1, 1, 1], head [1, 1, 1, 1],
            query [1, 1, c, 1], key [1, 1, 1, S]) indices giving which logits attention uses
            (a FlexAttention ``mask_mod``: packed documents), ANDed with causality.
    """
    B, T, h, _ = q.shape
    G = k.shape[2]
    acc = accumulate_dtype(q.dtype)
    kk = k.repeat_interleave(h // G, dim=2).transpose(1, 2).to(acc)  # [B, h, T, D]
    qq = (q.to(acc) * per_head(scale, 1)).transpose(1, 2)  # [B, h, T, D]
    best = torch.full((h,), float("-inf"), dtype=acc, device=q.device)
    for start in range(0, T, chunk):
        stop = min(T, start + chunk)
        s = qq[:, :, start:stop] @ kk[:, :, :stop].transpose(-1, -2)  # [B, h, c, stop]
        keys, queries = torch.arange(stop, device=q.device), torch.arange(start, stop, device=q.device)
        keep = keys <= queries[:, None]
        if allowed is not None:
            batch = torch.arange(B, device=q.device).view(B, 1, 1, 1)
            keep = keep & allowed(batch, torch.zeros_like(batch[:1]), queries.view(1, 1, -1, 1), keys.view(1, 1, 1, -1))
        s = s.masked_fill(~keep, float("-inf"))
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best


class TracksMaxLogits(nn.Module):
    """An attention module whose ``track_max_logits`` switch (record each head's max logit of every explicit
    forward) holds True or False: set to "no", which is truthy, the module recorded them at every forward
    (and paid for it), without a word.

    Its ``rotary``, built from the config, is not replaced by a RotaryEmbedding of other settings: one of theta=500
    on an MLA whose config says 1e4 rotated both paths by 500 while the config (what a checkpoint records) said
    1e4, without a word. A host library's own rotary (the transformers integration's) may replace it."""

    def __setattr__(self, name: str, value) -> None:
        if name == "track_max_logits":
            check_bool(name, value)
        if name == "rotary" and isinstance(value, RotaryEmbedding):
            current = self._modules.get("rotary")
            if isinstance(current, RotaryEmbedding) and rope_settings(value) != rope_settings(current):
                raise ValueError(f"rotary: this layer's RoPE is its config's ({current.extra_repr()}), got "
                                 f"{value.extra_repr()}; build the layer from config.replace(rope_theta=..., "
                                 f"rope_scaling=...) and load the weights into it")
        super().__setattr__(name, value)


def rope_settings(rotary: RotaryEmbedding) -> tuple:
    """What a RotaryEmbedding's rotation depends on: (dim, theta, interleave, scaling)."""
    return rotary.dim, rotary.theta, rotary.interleave, rotary.scaling


def record_max_logits(module, q: torch.Tensor, k: torch.Tensor) -> None:
    """Store ``module``'s per-head max logits of this forward and the seconds measuring took
    (``last_max_logits`` [h], ``max_logit_seconds``), for QK-Clip and diagnostics."""
    t0 = time.perf_counter()
    scale = module.scale.detach() if isinstance(module.scale, torch.Tensor) else module.scale
    module.last_max_logits = max_logits(q, k, scale)
    module.max_logit_seconds = time.perf_counter() - t0


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Scale, sinks: torch.Tensor,
                   mask: Optional[torch.Tensor] = None, causal: bool = False) -> torch.Tensor:
    """Attention whose softmax has one more logit per head, the sink, that attends to nothing
    (gpt-oss, DeepSeek-V4): p_s = exp(l_s) / (exp(sink_h) + sum_s' exp(l_s')).

    SDPA has no sink, so the logits are materialized ([B, h, T, S]): a reference for the short
    sequences trained here.

    Args:
        q: [B, T, h, D]; k: [B, S, G, D]; v: [B, S, G, Dv]; G divides h.
        scale: logit scale, a float or [h]; sinks: [h] logits.
        mask: [B, T, S] bool, True where a key is visible; causal: T == S causal (no mask).

    Returns:
        [B, T, h, Dv] in q's dtype; a row with no visible key gives 0 (its weight is all on the sink).
    """
    B, T, h, _ = q.shape
    S, G = k.shape[1], k.shape[2]
    acc = accumulate_dtype(q.dtype)
    qq = (q.to(acc) * per_head(scale, 1)).transpose(1, 2)  # [B, h, T, D]
    kk, vv = (t.to(acc).transpose(1, 2) for t in (k, v))  # [B, G, S, D]: broadcast over the heads when G == 1
    if G not in (1, h):
        kk, vv = (t.repeat_interleave(h // G, dim=1) for t in (kk, vv))
    s = qq @ kk.transpose(-1, -2)  # [B, h, T, S]
    if causal:
        keep = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
    elif mask is not None:
        keep = mask[:, None]
    else:
        keep = None
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    # +inf (all weight on the sink) met itself in the softmax as inf - inf = NaN: the largest finite logit is the same
    # sink, as sink_column takes it on the fused path
    info = torch.finfo(acc)
    sink = sinks.to(acc).clamp(info.min, info.max).view(1, h, 1, 1).expand(B, h, T, 1)
    p = torch.cat((s, sink), dim=-1).softmax(dim=-1)[..., :S]
    return (p @ vv).transpose(1, 2).to(q.dtype)


class _RefusedGradient(torch.autograd.Function):
    """The identity forward; a backward that raises ``message``. ``anchors``: tensors the refused
    gradient would have reached, made inputs so that a backward toward them meets the refusal."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, message: str, *anchors: torch.Tensor) -> torch.Tensor:
        ctx.message = message
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError(ctx.message)


def no_gradient_through(out: torch.Tensor, cache) -> torch.Tensor:
    """``out`` (attention over a latent cache's rows), whose backward raises when the cache's rows are quantized
    bytes: a decode step trained through such a cache got a gradient without the cached tokens' part (k_norm.rope's
    weight none at all), silently. The forward is unchanged, and nothing is wrapped outside autograd or for a
    dense cache, whose rows keep their history."""
    if not (torch.is_grad_enabled() and out.requires_grad and cache.rows.quantized):
        return out
    return _RefusedGradient.apply(
        out, f"cache: a kv_format={cache.kv_format!r} cache stores its rows as bytes, which carry no gradient, so "
             f"this backward would leave out every cached token's path to the latent projections and the key norm; "
             f"train through a kv_format='dense' cache, or decode under torch.no_grad()")


_DECODE_REFUSALS = {
    "eval": "attention: an MLA decode step in eval mode is inference (the absorbed weights and the decode op's fast "
            "paths, no autograd), so it has no gradient; to train through a decode step put the MLA modules in "
            "training mode (model.train(), or .train() on each MLA module to keep dropout off), or decode under "
            "torch.no_grad()",
    "evicting": "cache: an eviction policy moves cached rows without autograd, so a decode step's gradient over it "
                "would credit the tokens first written to the slots, not the tokens there now; train through a "
                "cache without a policy, or decode under torch.no_grad()",
    "step": "attention: decode_one_token's step (mla_decode_step) is inference only (it writes the cache in place, and "
            "its attention op has no backward), so it has no gradient; to train through a decode step call the "
            "layer, mla(x, cache), in training mode, or decode under torch.no_grad()",
}


def no_decode_gradient(out: torch.Tensor, x: torch.Tensor, layer: torch.nn.Module,
                       reason: str = "eval") -> torch.Tensor:
    """``out``, a decode step's output whose gradient would be wrong or missing, tied to the step's input
    ``x`` and ``layer``'s parameters that require grad, so that a backward through it raises rather than
    giving it without a word. ``reason``: "eval" (the step ran under ``torch.no_grad()`` in eval mode),
    "evicting" (the cache's policy moves rows without autograd) or "step" (``decode_one_token``'s step)."""
    anchors = tuple(t for t in (x, *layer.parameters()) if t.requires_grad)
    if not anchors:
        return out
    return _RefusedGradient.apply(out, _DECODE_REFUSALS[reason], *anchors)
