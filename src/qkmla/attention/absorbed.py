"""The absorbed form (MATH.md, "The absorbed form"): what decoding over a latent cache computes.

Because gamma_k^C ⊙ (c W_UK) = c W_UK diag(gamma_k^C), a QK-normed content score is

    qh_i^C . kh_{j,g}^C = rho(q_i^C) · rho(k_{j,g}^C) · (q_lat_i . c_j)
    q_lat_i = (gamma_q^C ⊙ gamma_k^C ⊙ q_i^C) W_UK^(g(i))^T                  (d_c)

so the query moves into latent space (:func:`latent_query`) and each cached token keeps
one scalar per KV group, r_{j,g} = sigma(c_j W_UK^(g)) (:func:`key_scalars`). Values need
no change: o = (sum_j p_j c_j) W_UV^(g) (:func:`values_out`). :func:`expand_keys` is the
baseline the absorbed form avoids: re-expanding every cached key at every step.

The weights these use (:class:`AbsorbedWeights`) are derived from ``kv_b_proj`` and the
norm weights. :class:`DerivedWeights` keeps them and re-derives them when a source
parameter changes: the check reads each tensor's version counter (bumped by every in-place
update: optimizer steps, ``load_state_dict``, ``copy_``) and storage (changed by ``.to()``).

Shapes follow [B, T, H, D]; head i reads KV group g(i) = i // (h / G).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..dtypes import cast
from ..norms import QKNorm, rows_per_head
from ..ops.small_linear import GroupedLinear


@dataclass
class AbsorbedWeights:
    """Weights of the absorbed form.

    w_uk: [G, d_n, d_c], W_UK^(g)^T per group: q_lat = (q^C ⊙ gamma_qk) rho(q^C) @ w_uk[g], and
        every group's content key of a token is c @ w_uk[g].T.
    gamma_qk: [d_n] (or [h, d_n], a row per head, with the projection scope's per-head weights),
        gamma_q^C ⊙ gamma_k^C, the weight the query's content norm uses, so both weights reach q_lat
        in that one norm; None for plain MLA.
    w_uv: [G, d_v, d_c], the value rows: o = o_lat @ w_uv[g].T.
    uk: W_UK as the op that forms the new tokens' content keys c W_UK^(g) and their norm statistic
        (``ops.small_linear.GroupedLinear`` over ``w_uk``, which picks the CPU kernel or the torch
        reference); made from ``w_uk`` when not given.
    """

    w_uk: torch.Tensor
    gamma_qk: Optional[torch.Tensor]
    w_uv: torch.Tensor
    uk: Optional[GroupedLinear] = None

    def __post_init__(self) -> None:
        if self.uk is None:
            self.uk = GroupedLinear(self.w_uk)


def absorb(kv_b_weight: torch.Tensor, q_norm: Optional[QKNorm], k_norm: Optional[QKNorm],
           num_kv_groups: int, qk_nope_head_dim: int, track: bool = False) -> AbsorbedWeights:
    """Split ``kv_b_proj.weight`` [G (d_n + d_v), d_c] into W_UK and W_UV per group and fold
    the content norm weights together: without autograd (weights kept between decode steps), or with
    ``track`` for a step autograd records through, so that its gradient reaches ``kv_b_proj`` and the
    norm weights (derived without it, a decode step's backward left them out of the gradient)."""
    with torch.set_grad_enabled(track and torch.is_grad_enabled()):
        def own(t):
            return t if track else t.detach()

        w = own(kv_b_weight).view(num_kv_groups, -1, kv_b_weight.shape[-1])  # [G, d_n + d_v, d_c]
        gamma_qk = None
        if q_norm is not None:
            gamma_q = own(q_norm.content.weight)
            gamma_qk = gamma_q * rows_per_head(own(k_norm.content.weight), gamma_q.shape[0])
        w_uk = w[:, :qk_nope_head_dim].contiguous()
        if track:  # the kernels' packed copies carry no gradient: the torch reference over w_uk itself
            return AbsorbedWeights(w_uk, gamma_qk, w[:, qk_nope_head_dim:].contiguous(), GroupedLinear(w_uk))
        # The content keys themselves are formed only where the key scalar reads more than them
        # (a unified norm's, the projection scope's): there the op keeps a copy for its kernel.
        uk = GroupedLinear(w_uk, pack=k_norm is not None and not reads_content_only(k_norm), build=k_norm is not None)
        return AbsorbedWeights(w_uk, gamma_qk, w[:, qk_nope_head_dim:].contiguous(), uk)


_optimizer_steps = 0


def _count_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


# Fused optimizers (AdamW(fused=True), Trainer's default) write the weights without bumping
# their version counters; any optimizer step, anywhere, therefore invalidates kept weights.
register_optimizer_step_post_hook(_count_step)


def _version(sources: list[torch.Tensor]) -> tuple:
    return (_optimizer_steps,) + tuple((p._version, p.data_ptr(), p.dtype, p.device) for p in sources)


class DerivedWeights:
    """Absorbed weights kept between calls and re-derived when a source parameter changes.

    ``get(sources, derive)`` returns the kept weights while every tensor in ``sources``
    has the version counter, storage, dtype and device it had when they were derived and no
    ``torch.optim`` optimizer has stepped since, and ``derive()`` otherwise. A change PyTorch
    cannot see (through ``.data`` of a detached alias) needs ``get(..., force=True)``.
    """

    def __init__(self):
        self.weights: Optional[AbsorbedWeights] = None
        self.key: Optional[tuple] = None

    def get(self, sources: list[torch.Tensor], derive: Callable[[], AbsorbedWeights],
            force: bool = False) -> AbsorbedWeights:
        key = _version(sources)
        if force or self.weights is None or key != self.key:
            self.weights, self.key = derive(), key
        return self.weights


def per_group(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each head times its group's matrix: x [B, T, h, d_in], w [G, d_in, d_out] -> [B, T, h, d_out]."""
    B, T, h, d_in = x.shape
    G = w.shape[0]
    y = torch.einsum("btgnd,gde->btgne", x.view(B, T, G, h // G, d_in), w)
    return y.reshape(B, T, h, w.shape[-1])


def latent_query(q_c: torch.Tensor, q_r: torch.Tensor, q_norm: Optional[QKNorm],
                 w: AbsorbedWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """q^C [B, T, h, d_n], q~^R [B, T, h, d_r] -> (q_lat [B, T, h, d_c], q~^R normalized, not yet rotated).

    The content norm runs with gamma_q^C ⊙ gamma_k^C in place of gamma_q^C, so the query's
    scalar and both weights ride into q_lat through one norm.
    """
    if q_norm is not None:
        q_c, q_r = q_norm(q_c, q_r, content_weight=w.gamma_qk)
    return per_group(q_c, w.w_uk), q_r


def key_scalars(c_kv: torch.Tensor, k_r: torch.Tensor, k_norm: Optional[QKNorm],
                w: Optional[AbsorbedWeights]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """c [B, T, d_c], k~^R [B, T, 1, d_r] -> (k~^R normalized, not yet rotated; key scalars [B, T, G]
    or None; [B, T, 1] with the projection scope).

    Every group's content key c W_UK^(g) is formed (one product for all groups), reduced to
    its scalar and discarded: only the new tokens pay for it, whatever the context length.
    Unified mode has one scalar for [k^C; k^R] (content mode one from k^C alone), which scales
    the whole logit at decode time; the stored RoPE key then keeps only its weight.
    """
    if k_norm is None:
        return k_r, None
    r = latent_key_scalars(c_kv, k_norm, w)
    if r is not None:  # the scalar reads c alone
        return rope_key(k_r, k_norm), r
    # Every group reads the same c: one product against all groups' W_UK rows [G d_n, d_c].
    k_c = w.uk(c_kv)  # [B, T, G, d_n]
    sigma, sigma_r = k_norm.statistics(k_c, k_r)  # [B, T, 1, 1] each with the projection scope
    if k_norm.mode == "blockwise":
        return k_norm.rope.scaled(k_r, sigma_r), sigma.squeeze(-1)
    return k_r * cast(k_norm.rope.weight, k_r.dtype), sigma.squeeze(-1)


def reads_content_only(k_norm: QKNorm) -> bool:
    """Whether a key's scalar is a function of its own content key alone: every mode but unified
    (whose statistic reads the RoPE key too), with one statistic per head (not the projection's)."""
    return k_norm.mode != "unified" and k_norm.scope == "head"


def content_key_scalars(k_c: torch.Tensor, k_norm: QKNorm) -> Optional[torch.Tensor]:
    """Key scalars [..., G] from the content keys k_c = c W_UK [..., G, d_n] alone (what
    :func:`key_scalars` caches), or None where the scalar also reads the RoPE key before its
    weight and rotation (unified mode) or other heads (the projection scope)."""
    if not reads_content_only(k_norm):
        return None
    return k_norm.content.statistic(k_c).squeeze(-1)


def latent_key_scalars(c_kv: torch.Tensor, k_norm: QKNorm, w: AbsorbedWeights) -> Optional[torch.Tensor]:
    """c [..., d_c] -> the key scalars [..., G] of :func:`content_key_scalars`, from the latent (None
    where it gives None), float32 (float64 for float64 c).

    One op call (``w.uk.statistic``): in bfloat16 on a CPU with qkmla's kernel, the content keys
    never leave it and W_UK is read where it lies (the vLLM plugin passes vLLM's own view of
    ``kv_b_proj``'s weight); elsewhere the keys are formed with one GEMM and reduced."""
    if not reads_content_only(k_norm):
        return None
    norm = k_norm.content
    return w.uk.statistic(c_kv, norm.kind, norm.p, norm.eps)


def bind_latent_key_scalars(k_norm: QKNorm, w: AbsorbedWeights) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """:func:`latent_key_scalars` with the norm and weights bound and checked once, c [T, d_c] ->
    [T, G] (``w.uk.bind_statistic``), for a caller outside a compiled graph that
    forms a decode step's key scalars on every step (the vLLM plugin's cache write); None where
    :func:`latent_key_scalars` gives None."""
    if not reads_content_only(k_norm):
        return None
    norm = k_norm.content
    return w.uk.bind_statistic(norm.kind, norm.p, norm.eps)


def rope_key(k_r: torch.Tensor, k_norm: QKNorm) -> torch.Tensor:
    """k~^R [..., d_r] as cached where the key scalar reads c alone (:func:`reads_content_only`): with
    its own norm (blockwise) or only its weight (content mode, whose scalar scales the whole logit)."""
    if k_norm.mode == "blockwise":
        return k_norm.rope(k_r)
    return k_r * cast(k_norm.rope.weight, k_r.dtype)


def score_mode(k_norm: Optional[QKNorm]) -> str:
    """How a key scalar enters a logit (the decode op's ``mode``): "blockwise" without a QK norm
    or with a blockwise one, "unified" (the whole logit) for the unified and content norms."""
    return "blockwise" if k_norm is None or k_norm.mode == "blockwise" else "unified"


def values_out(o_lat: torch.Tensor, w: AbsorbedWeights) -> torch.Tensor:
    """o = o_lat W_UV^(g) per head: [B, T, h, d_c] -> [B, T, h, d_v]."""
    return per_group(o_lat, cast(w.w_uv, o_lat.dtype).transpose(1, 2))


def expand_keys(latent: torch.Tensor, key_scale: Optional[torch.Tensor], kv_b_proj: torch.nn.Module,
                k_norm: Optional[QKNorm], config) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style: cached latents [B, S, d_c + d_r] (and key scalars [B, S, G]) up-projected to
    normalized keys [B, S, G, d_n + d_r] and values [B, S, G, d_v] with ``kv_b_proj``."""
    c = config
    dtype = kv_b_proj.weight.dtype
    c_kv, k_r = latent.to(dtype).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
    kv = kv_b_proj(c_kv).view(*c_kv.shape[:2], c.num_kv_groups, c.qk_nope_head_dim + c.v_head_dim)
    k_c, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    k_r = k_r.unsqueeze(2).expand(*k_c.shape[:3], c.qk_rope_head_dim)
    if k_norm is not None:
        r = key_scale.to(dtype).unsqueeze(-1)  # [B, S, G, 1]: the cached scalars
        k_c = k_c * k_norm.content.weight.to(dtype) * r
        if k_norm.mode != "blockwise":  # the scalar scales the whole key
            k_r = k_r * r
    return torch.cat((k_c, k_r), dim=-1), v
