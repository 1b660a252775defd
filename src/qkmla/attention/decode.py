"""One absorbed decode step as a plain function that ``torch.compile(fullgraph=True)`` captures.

gpt-fast's ``decode_one_token``, for one MLA layer over a contiguous :class:`LatentCache`:
:func:`mla_decode_step` takes only tensors (and the module), writes the new token's row into
the cache buffers in place and hands the attention op the whole buffers with each
sequence's visible length, so its shapes never change from one step to the next and nothing
traced reads a tensor's value on the host (the opaque op then reads only the slots up to
the longest sequence's last).
:func:`decode_one_token` is the eager wrapper: it plans the write (capacity and position
checks), runs the step and moves the cache's lengths on.

    step = torch.compile(mla_decode_step, fullgraph=True)
    y = decode_one_token(mla, x, cache, step=step)          # x [B, 1, hidden] -> [B, 1, hidden]

A shorter sequence's unused slots are zeroed before they are read (they may hold anything,
NaN included), so a batch of uneven lengths works as ``MLA.forward`` does. The step is for
inference (run it under ``torch.no_grad()`` or ``torch.inference_mode()``): it writes the
cache in place and has no backward (:func:`decode_one_token` runs it without autograd, and a
backward through its output raises, naming the way to train through a decode step). A quantized
cache (``kv_format``) works the same way: the step encodes the new row in the cache's format
(key scalars from the stored latent) and the attention dequantizes a chunk of keys at a time.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

from ..cache.latent import LatentCache
from ..cache.storage import ContiguousBuffer
from ..kv_formats import row_format
from ..ops.mla_decode.torch_impl import fold_head_scale, latent_attention_op
from ..rope import check_position_range, position_range
from .absorbed import AbsorbedWeights, key_scalars, latent_query, values_out
from .functional import check_cache_device, check_hidden, no_decode_gradient
from .mla import MLA
from .sinks import apply_sinks


def mla_decode_step(mla: MLA, x: torch.Tensor, absorbed: AbsorbedWeights, latent: torch.Tensor,
                    key_scale: Optional[torch.Tensor], slots: torch.Tensor, positions: torch.Tensor,
                    kv_format: str = "dense") -> torch.Tensor:
    """One new token per sequence through ``mla``'s absorbed path.

    Args:
        x: [B, 1, hidden_size].
        absorbed: ``mla.absorbed`` (looked up by the caller: the refresh check reads version
            counters, which a compiled graph does not).
        latent: [B, capacity, d_c + d_r], the cache's ``latent`` buffer, written in place
            (uint8 [B, capacity, row bytes] for a quantized ``kv_format``).
        key_scale: [B, capacity, G], the cache's ``key_scale`` buffer (written in place), or None.
        slots: [B] the slot each new token is written to; positions: [B] its RoPE position.
        kv_format: the cache's row format (``qkmla.kv_formats``).

    Returns:
        [B, 1, hidden_size]
    """
    rows = torch.arange(latent.shape[0], device=x.device)
    pos = positions[:, None]
    q_lat, q_r = latent_query(*mla.raw_query(x), mla.q_norm, absorbed)
    c_kv, k_r = mla.latent(x)
    fmt = row_format(kv_format, c_kv.shape[-1], k_r.shape[-1])
    k_r, r = key_scalars(fmt.stored_latent(c_kv, latent.dtype), k_r, mla.k_norm, absorbed)
    latent[rows, slots] = fmt.encode(c_kv, mla.rotary(k_r, pos).squeeze(2))[:, 0].to(latent.dtype)
    if key_scale is not None:
        key_scale[rows, slots] = r[:, 0].to(key_scale.dtype)
    q_lat, q_rope, scale = fold_head_scale(q_lat, mla.rotary(q_r, pos), mla.scale)
    # The op reads the queries as [B, T h, d] rows, and per_group's einsum may hand q_lat back
    # with its batch and group dimensions swapped (the bmm runs group-major): lay both out
    # here, inside the graph, where inductor fuses the copy, not in the opaque op.
    q_lat, q_rope = q_lat.contiguous(), q_rope.contiguous()
    # One opaque op: compiled, only the code around it is traced (see latent_attention_op).
    # Each sequence sees its slots up to the new token's.
    o_lat, lse = latent_attention_op(q_lat, q_rope, latent, key_scale, float(scale), slots[:, None] + 1,
                                     mla.score_mode, kv_format)
    if mla.sinks is not None:
        o_lat = apply_sinks(o_lat, lse, mla.sinks)
    out = mla.o_proj(values_out(o_lat, absorbed).flatten(2))
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        # Called directly where autograd records it, its backward failed deep in torch ("no autograd
        # formula was registered" for the opaque op): it says what the step is instead, as
        # decode_one_token's output does.
        return no_decode_gradient(out, x, mla, reason="step")
    return out


def decode_one_token(mla: MLA, x: torch.Tensor, cache: LatentCache,
                     step: Callable[..., torch.Tensor] = mla_decode_step) -> torch.Tensor:
    """``mla(x, cache)`` for one new token per sequence, through ``step`` (e.g. compiled).

    x: [B, 1, hidden_size] -> [B, 1, hidden_size]. The cache must be contiguous. A cache with an
    eviction policy runs it after the step, as ``mla(x, cache)`` does (outside the compiled step).
    The step is inference: where autograd would record it, it runs under ``torch.no_grad()`` and a
    backward through its output raises (as ``mla(x, cache)``'s eval-mode step does).
    """
    if not isinstance(mla, MLA):
        raise ValueError(f"mla: expected an MLA layer, got {type(mla).__name__}")
    if not isinstance(cache, LatentCache) or not isinstance(cache.fields["latent"], ContiguousBuffer):
        raise ValueError("cache: decode_one_token needs a contiguous LatentCache (the default layout)")
    # x as MLA's forward checks it: x of another dtype, width or device than the layer's weights, or no tensor,
    # failed deep in the step's first projection ("expected m1 and m2 to have the same dtype", "mat1 and mat2
    # shapes cannot be multiplied", "'list' object has no attribute 'dim'"), naming nothing
    check_hidden(x, mla.config.hidden_size, mla.o_proj.weight.dtype, mla.o_proj.weight.device)
    if x.shape[1] != 1:
        raise ValueError(f"x: expected one new token per sequence, [B, 1, hidden_size], got {tuple(x.shape)}")
    cache.check_config(mla.config)
    check_cache_device(cache, x)
    slot = cache.plan(x.shape[0], 1, writer=mla)
    if slot.positions.device.type == "cpu":
        # The eager step's RoPE checks its positions where reading them is free (rope.check_positions); a compiled
        # step skips that check, and rotated positions past 2**24 as rounded ones without a word: checked here,
        # outside the graph, where the eager path checks them
        check_position_range("positions", *position_range(slot.positions), x.dtype)
    scales = cache.fields.get("key_scale")
    # Recorded by autograd (training mode, or eval outside no_grad), the step's backward failed deep in torch
    # ("no autograd formula was registered" for the opaque op), and its weights (mla.absorbed, derived without
    # autograd) would have left kv_b_proj and the norm weights out anyway; its writes also gave the cache's
    # buffers the step's graph. Run without autograd, and a backward through the output says so.
    recorded = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in mla.parameters()))
    untracked = torch.no_grad() if recorded else contextlib.nullcontext()
    with cache.transaction(), untracked:  # as MLA.forward: a failure after the write takes the token out again
        out = step(mla, x, mla.absorbed, cache.fields["latent"].data, scales.data if scales is not None else None,
                   slot.slots[:, 0], slot.positions[:, 0], cache.kv_format)
        cache.advance(slot)
        cache.after_attention(mla, slot, lambda: mla.absorbed_query(x, slot.positions))
    return no_decode_gradient(out, x, mla, reason="step") if recorded else out
