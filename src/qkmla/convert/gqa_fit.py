"""The fitted parts of a GQA -> MLA conversion (:func:`~qkmla.convert.gqa.convert_gqa`): the rank-r
factorization of the stacked key and value weights, the mix of the KV groups' RoPE rows that becomes
DeepSeek's one shared RoPE key, and the calibration moments both can be fitted to (MATH.md, "Content
variant").

Everything here is float64 and reads the source model without changing it.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

ROPE_KEYS = ("mean", "principal")  # how the G groups' kept RoPE rows become the one shared RoPE key
LATENTS = ("weights", "activations")  # what the rank-r factorization of [W_K ; W_V] is best for


def latent_factors(model, G: int, D: int, inputs: Optional[list[torch.Tensor]] = None) -> list[tuple]:
    """Per layer, (U, S, B) in float64 with [W_K^0 ; W_V^0 ; W_K^1 ; ...] = U diag(S) B [2 G D, hidden]:
    the latent is B[:r] x and the keys and values U[:, :r] S[:r] times it.

    Without ``inputs``, the SVD of the weights (B = V^T, orthonormal rows): the rank-r truncation is the
    best for every input alike. With ``inputs`` (per layer the second moment Sigma [hidden, hidden] of
    the attention's input over calibration tokens), the SVD of M Sigma^(1/2) = U S V^T and
    B = V^T Sigma^(-1/2) (its rows scaled to unit length, U's columns by the inverse): the truncation
    minimizes the error of the keys and values on those inputs, E|M x - U_r S_r B_r x|^2
    (activation-aware SVD), and the full rank is M again.
    """
    out = []
    for i, layer in enumerate(model.model.layers):
        m = stacked_kv(layer, G, D)
        if inputs is None:
            out.append(torch.linalg.svd(m, full_matrices=False))
            continue
        sigma = inputs[i].to(m.device)
        # a ridge of 1e-8 of the mean eigenvalue keeps Sigma^(-1/2) finite where the inputs span less
        ridge = 1e-8 * sigma.diagonal().mean() * torch.eye(len(sigma), dtype=torch.float64, device=m.device)
        lam, Q = torch.linalg.eigh(sigma + ridge)
        lam = lam.clamp_min(1e-8 * float(lam.max()))
        U, S, Vh = torch.linalg.svd(m @ (Q * lam.sqrt()) @ Q.T, full_matrices=False)
        B = Vh @ (Q * lam.rsqrt()) @ Q.T
        # unit rows, their lengths moved into U's columns (U S B unchanged): Sigma^(-1/2) can be large
        # where the inputs barely vary, and the constant latent channel is sized by |B_r|_2 <= sqrt(r)
        lengths = B.norm(dim=1)
        out.append((U * lengths, S, B / lengths[:, None]))
    return out


def stacked_kv(layer, G: int, D: int) -> torch.Tensor:
    """[W_K^0 ; W_V^0 ; W_K^1 ; W_V^1 ; ...] [2 G D, hidden] of a source decoder layer, in float64."""
    a = layer.self_attn
    k = a.k_proj.weight.detach().double().view(G, D, -1)
    v = a.v_proj.weight.detach().double().view(G, D, -1)
    return torch.cat((k, v), dim=1).flatten(0, 1)


def kv_rank(model, G: int, D: int) -> int:
    """The largest numerical rank of a layer's [W_K ; W_V]: the latent rank that is exact (for the
    activation-weighted factorization too, its inputs' moment being of full rank by its ridge)."""
    return max(numerical_rank(torch.linalg.svdvals(m := stacked_kv(layer, G, D)), m.shape)
               for layer in model.model.layers)


def check_calibration(calibration, rope_key: str, latent: str, vocab_size: int) -> None:
    if rope_key not in ROPE_KEYS:
        raise ValueError(f"rope_key: expected one of {ROPE_KEYS}, got {rope_key!r}")
    if latent not in LATENTS:
        raise ValueError(f"latent: expected one of {LATENTS}, got {latent!r}")
    if calibration is None:
        if rope_key == "principal":
            raise ValueError("calibration: rope_key='principal' takes its mix from the keys of calibration tokens; "
                             "pass calibration=input_ids ([B, T] token ids of text like the model's)")
        if latent == "activations":
            raise ValueError("calibration: latent='activations' weights the factorization by the attention inputs of "
                             "calibration tokens; pass calibration=input_ids ([B, T] token ids of text like the "
                             "model's)")
        return
    if not isinstance(calibration, torch.Tensor) or calibration.dim() != 2 or calibration.dtype not in (
            torch.int32, torch.int64) or calibration.numel() == 0:
        raise ValueError(f"calibration: expected a [B, T] int64 tensor of token ids, got "
                         f"{type(calibration).__name__} {getattr(calibration, 'dtype', '')} "
                         f"{tuple(getattr(calibration, 'shape', ()))}")
    if calibration.is_meta:  # its range is read below: "Tensor.item() cannot be called on meta tensors"
        raise ValueError("calibration: on the meta device (shapes only), so it holds no token ids; pass it on the cpu "
                         "or the model's device")
    if int(calibration.min()) < 0 or int(calibration.max()) >= vocab_size:
        raise ValueError(f"calibration: token ids must lie in [0, vocab_size={vocab_size}), got "
                         f"{int(calibration.min())}..{int(calibration.max())}")


@contextlib.contextmanager
def _experts_in_its_dtype(model):
    """A float64 MoE source (OLMoE) runs its experts eagerly inside the block, and as it was after: transformers'
    default, grouped_mm, takes no float64, and `qkmla convert-gqa --dtype float64 --calibration-text T` of an OLMoE
    checkpoint ended in its RuntimeError ("Expected mat_a to be Float32, ..."), an internal error."""
    from ..integrations.transformers.load import _experts_for_dtype

    before = getattr(model.config, "_experts_implementation", None)
    _experts_for_dtype(model, None)
    try:
        yield
    finally:
        if getattr(model.config, "_experts_implementation", None) != before:
            model.set_experts_implementation(before)


def calibration_moments(model, calibration: torch.Tensor, pairs: list[int], G: int, D: int, weighted_rows: bool,
                        batch: int = 8) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer, (C [m, G, G], Sigma [hidden, hidden]) in float64 over the calibration tokens: Sigma the
    second moment of the attention's input (what k_proj and v_proj read: :func:`latent_factors`), and
    C, for each kept pair j, the second moment of the G groups' raw keys at the pair's dims (j, j + D/2)
    (``weighted_rows``: times the key norm's weight per channel, which a kept norm over the projection
    puts into the RoPE key's rows). Each token's keys are divided by one RMS
    over all its groups, so that tokens count alike while the groups' keys keep their ratios: the shared
    key is mixed from raw rows, and each group's statistic then scales its heads' whole score. A G x G
    moment of 2-vectors rotated alike is unchanged by RoPE, so it holds at every position."""
    dims = torch.tensor([[j, j + D // 2] for j in pairs])
    moments = [torch.zeros(len(pairs), G, G, dtype=torch.float64) for _ in model.model.layers]
    hidden = model.config.hidden_size
    inputs = [torch.zeros(hidden, hidden, dtype=torch.float64) for _ in model.model.layers]
    counts = [0] * len(moments)

    def grab(module, args, output, i):
        x = args[0].detach().to(torch.float64).reshape(-1, hidden).cpu()
        inputs[i] += x.T @ x
        k = output.detach().to(torch.float64).reshape(-1, G, D)
        k = k * (k.square().mean((-2, -1), keepdim=True) + 1e-12).rsqrt()
        if weighted_rows:
            k = k * model.model.layers[i].self_attn.k_norm.weight.detach().to(torch.float64).view(G, D)
        k = k[:, :, dims.to(k.device)].cpu()  # [N, G, m, 2]
        moments[i] += torch.einsum("ngmc,nhmc->mgh", k, k)
        counts[i] += k.shape[0]

    hooks = [layer.self_attn.k_proj.register_forward_hook(lambda m, a, o, i=i: grab(m, a, o, i))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad(), _experts_in_its_dtype(model):
            for chunk in calibration.split(batch):
                model(input_ids=chunk.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [m / c for m, c in zip(moments, counts)], [x / c for x, c in zip(inputs, counts)]


def rope_key_mix(moment: Optional[torch.Tensor], rope_key: str, m: int, G: int) -> tuple:
    """(key weights [m, G], query scales [m, G], energy or None) of each kept pair's shared RoPE key
    k^R = sum_g w_g k_g, read by a head of group g as s_g q . k^R. "mean": w = 1/G, s = 1 (equivalently
    the unit mix 1/sqrt(G) on both sides). "principal": w = s = u, the unit top eigenvector of the pair's
    moment, so that s_g k^R = u_g (u . k) is the least-squares fit of every group's key from one vector
    (exact when the groups' keys at that pair are multiples of one another): TransMLA's RoRoPE, one
    rotation across groups per frequency, keeping its first component."""
    if rope_key == "mean":
        w, q = torch.full((m, G), 1.0 / G, dtype=torch.float64), torch.ones(m, G, dtype=torch.float64)
        u = torch.full((m, G), G ** -0.5, dtype=torch.float64)
    else:
        u = torch.linalg.eigh(moment).eigenvectors[..., -1]  # [m, G], unit, the largest eigenvalue's
        u = u * torch.where(u.sum(-1, keepdim=True) < 0, -1.0, 1.0)  # a sign convention (either fits)
        w, q = u, u
    energy = None
    if moment is not None:
        energy = float(torch.einsum("mg,mgh,mh->", u, moment, u) / moment.diagonal(dim1=-2, dim2=-1).sum())
    return w, q, energy


def numerical_rank(s: torch.Tensor, shape) -> int:
    return int((s > s[0] * max(shape) * torch.finfo(s.dtype).eps).sum()) if s[0] > 0 else 1
