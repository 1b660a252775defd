"""From a DeepSeek attention layer to a QK-normed one, and converted layers on disk.

What a converted layer computes at the start. ``mla_from_hf(layer, qk_norm="rms")`` (or
``mla_layers_from_hf_dir(..., qk_norm="rms")``) keeps every projection of the source layer and adds
the QK norms with their weights at ones. Its logits are then

    s = tau · ( qh^C · kh^C + RoPE(qh^R) · RoPE(kh^R) ),   each qh, kh = v · rho(v): RMS 1 per head

instead of the source's tau · (q^C · k^C + RoPE(q^R) · RoPE(k^R)). That is a different function:
every score loses its query's and key's magnitudes, so its size is set by d_n, d_r and the
angle between them (|qh^C · kh^C| <= d_n), not by the trained norms. A checkpoint whose q and k
are far from RMS 1 gets logits far off: in the 3-layer test model of tests/interop/conftest.py
with transformers' initialization, the logits' RMS is 65x the source's; with attention weights
10x larger (logits of a few units), 0.65x.

The warm start (:func:`warm_start_qk_norm`) sets the norm weights so that the first logits have
the source layer's scale on a calibration batch: for each block b (content, RoPE), gamma_q^b and
gamma_k^b are constants, each side brought to the source's RMS and then both multiplied by
sqrt(c_b), with c_b chosen so that the RMS of the block's causal scores equals the source's
exactly. It cannot make the layer compute the source function: what a norm removes, each token's
and each head's magnitude, no weight shared by all tokens and heads can restore. So logits
match in scale, not value. Measured on held-out inputs of the same test model (real hidden
states from transformers' forward; calibration on another batch): logit RMS ratio 0.97 to 1.02
per layer; relative output error against the source 0.69-1.16 -> 0.003-0.005 (transformers'
init, near-uniform attention) and 0.18-0.40 -> 0.13-0.32 (10x weights, where the lost per-token
magnitudes matter; logit correlation with the source 0.95 -> 0.97). Proxy inputs
(:func:`proxy_calibration`, what ``qkmla convert --warm-start`` uses) gave the same figures
to two digits in that model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Mapping, Optional, Union

import torch
from safetensors import safe_open

from ..attention.functional import default_positions, per_head
from ..attention.mla import MLA
from ..config import MLAConfig
from ..dtypes import check_float_state
from ..files import check_output, same_file, save_safetensors, write_text
from ..limits import check_fits
from .checkpoint import mla_layers_from_hf_dir, read_hf_config, read_hf_tensors
from .hf import _OURS

CONVERTED_CONFIG = "qkmla_config.json"
CONVERTED_WEIGHTS = "model.safetensors"


def _block_scores(q: torch.Tensor, k: torch.Tensor, scale, heads_per_group: int) -> torch.Tensor:
    """Causal scores scale · q·k of one block: q [B, T, h, d], k [B, T, G, d] -> [n], one per visible
    (query, key) pair."""
    k = k.repeat_interleave(heads_per_group, dim=2)
    s = torch.einsum("bthd,bshd->bhts", q, k) * per_head(scale, 2)
    T = q.shape[1]
    return s[..., torch.ones(T, T, dtype=torch.bool, device=q.device).tril()].flatten()


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


def warm_start_qk_norm(mla: MLA, source: MLA, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> dict:
    """Set ``mla``'s QK-norm weights so that its logits on ``x`` have ``source``'s scale.

    Args:
        mla: the QK-normed layer (its projections copied from ``source``; its norm weights are overwritten).
        source: the layer to match, usually the same weights without a QK norm (the HF layer's function).
        x: calibration inputs [B, T, hidden_size]: the hidden states this layer sees (after the
            block's input RMSNorm), as many tokens as convenient.
        positions: [B, T] or [T]; default 0..T-1.

    Returns:
        {"content": {...}, "rope": {...}}: per block, the weights set (``gamma_q``, ``gamma_k``) and the
        RMS of the source's and of the new layer's causal logits before (``rms_source``,
        ``rms_unit_weights``) and after (``rms_warm``) the warm start.

    Raises:
        ValueError: ``mla`` has no QK norm, or the two layers differ in shape.
    """
    if mla.q_norm is None:
        raise ValueError("mla: has no QK norm to warm start (build it with qk_norm='rms', 'l2' or 'lp')")
    shape = ("hidden_size", "num_heads", "num_kv_groups", "qk_nope_head_dim", "qk_rope_head_dim")
    if any(getattr(mla.config, f) != getattr(source.config, f) for f in shape):
        raise ValueError(f"source: its shape ({', '.join(shape)}) differs from mla's")
    positions = default_positions(x, positions)
    d_n, hpg = mla.config.qk_nope_head_dim, mla.config.heads_per_group
    blocks = {"content": slice(0, d_n), "rope": slice(d_n, None)}
    report = {}
    with torch.no_grad():
        for norm in (mla.q_norm, mla.k_norm):
            norm.content.weight.fill_(1.0)
            norm.rope.weight.fill_(1.0)
        q_src, k_src, _ = source.explicit_qkv(x, positions)
        q_new, k_new, _ = mla.explicit_qkv(x, positions)  # unit weights: the statistic alone
        for name, cols in blocks.items():
            # Each side's weight first brings its vectors to the source's size (so q and k keep the
            # source's balance), then one factor c_b, shared by both, matches the scores' RMS.
            m_q = _rms(q_src[..., cols]) / _rms(q_new[..., cols])
            m_k = _rms(k_src[..., cols]) / _rms(k_new[..., cols])
            rms_source = _rms(_block_scores(q_src[..., cols], k_src[..., cols], source.scale, hpg))
            rms_unit = _rms(_block_scores(q_new[..., cols], k_new[..., cols], mla.scale, hpg))
            c = rms_source / (m_q * m_k * rms_unit)
            gamma_q, gamma_k = m_q * math.sqrt(c), m_k * math.sqrt(c)
            getattr(mla.q_norm, name).weight.fill_(gamma_q)
            getattr(mla.k_norm, name).weight.fill_(gamma_k)
            report[name] = dict(gamma_q=gamma_q, gamma_k=gamma_k, rms_source=rms_source, rms_unit_weights=rms_unit)
        q_new, k_new, _ = mla.explicit_qkv(x, positions)
        for name, cols in blocks.items():
            report[name]["rms_warm"] = _rms(_block_scores(q_new[..., cols], k_new[..., cols], mla.scale, hpg))
    return report


def check_converted_out(out_dir: Union[str, Path], overwrite: bool = False, source: Union[str, Path, None] = None,
                        name: str = "out") -> Path:
    """Before any work: ``out_dir`` can take a conversion. Refused (ValueError naming ``name``):
    the source directory itself or any file in it, a path that is a file, and a directory
    that already holds a conversion unless ``overwrite``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{name}: {out} is a file; it names the directory the conversion is written to")
    inputs = []
    if source is not None and Path(source).is_dir():
        if same_file(out, source):
            raise ValueError(f"{name}: {out} is the checkpoint being converted; writing there would replace its own "
                             f"files, so write elsewhere")
        inputs = [p for p in Path(source).iterdir() if p.is_file()]
    check_output(name, [out / CONVERTED_WEIGHTS, out / CONVERTED_CONFIG], inputs, overwrite, "conversion's")
    return out


def save_converted(layers: Mapping[int, MLA], out_dir: Union[str, Path], source: str = "",
                   overwrite: bool = False) -> Path:
    """Write converted layers: ``model.safetensors`` (HF names, ``model.layers.{i}.self_attn.*``,
    plus the QK-norm weights) and ``qkmla_config.json`` (the MLAConfig, the layer indices, the source).
    Each file is written to a temporary name and renamed (``qkmla.files``), so a crash or a full
    disk leaves what was there. A conversion already in ``out_dir`` is replaced only with
    ``overwrite``; the source directory ``source`` never is.

    Raises:
        ValueError: no layers, layers with different configs, or an ``out_dir`` refused by
            :func:`check_converted_out`.
        OSError: naming the file that could not be written.
    """
    if not layers:
        raise ValueError("layers: nothing to save")
    configs = {m.config for m in layers.values()}
    if len(configs) != 1:
        raise ValueError("layers: every layer must share one MLAConfig")
    out = check_converted_out(out_dir, overwrite, source or None)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out: cannot make the directory {out} ({e.strerror})") from None
    tensors = {f"model.layers.{i}.self_attn.{k}": v.detach().cpu().contiguous()
               for i, m in layers.items() for k, v in m.state_dict().items()}
    meta = {"mla_config": dataclasses.asdict(configs.pop()), "layers": sorted(layers), "source": str(source)}
    # The weights first: a config beside weights it does not describe would load as garbage,
    # while new weights beside an old config fail load_converted's shape check.
    save_safetensors(tensors, out / CONVERTED_WEIGHTS, metadata={"format": "pt", "producer": "qkmla convert"})
    write_text(out / CONVERTED_CONFIG, json.dumps(meta, indent=1) + "\n")
    return out


def load_converted(out_dir: Union[str, Path]) -> dict[int, MLA]:
    """The layers :func:`save_converted` wrote, {layer index: MLA} in the stored dtype.

    Raises:
        ValueError: naming the file that is missing or does not hold what was saved.
    """
    root = Path(out_dir)
    meta_path, weights = root / CONVERTED_CONFIG, root / CONVERTED_WEIGHTS
    for p in (meta_path, weights):
        if not p.is_file():
            raise ValueError(f"out_dir: {p} does not exist (write it with `qkmla convert`)")
    try:
        meta = json.loads(meta_path.read_text())
        config = MLAConfig(**meta["mla_config"])
        indices = [int(i) for i in meta["layers"]]
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{meta_path}: not a qkmla convert config ({e})") from None
    layers = {}
    with safe_open(str(weights), framework="pt") as f:
        for i in indices:
            prefix = f"model.layers.{i}.self_attn."
            state = {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
            if "kv_b_proj.weight" not in state:
                raise ValueError(f"{weights}: layer {i} (listed in {meta_path}) has no {prefix}kv_b_proj.weight")
            mla = MLA(config)
            check_float_state(state, mla, str(weights))
            mla = mla.to(state["kv_b_proj.weight"].dtype)
            try:
                mla.load_state_dict(state)
            except RuntimeError as e:
                raise ValueError(f"{weights}: layer {i} does not match {meta_path} ({e})") from None
            layers[i] = mla
    return layers


def plain_copy(mla: MLA) -> MLA:
    """The same projections without a QK norm: the source function a converted layer started from."""
    plain = MLA(mla.config.replace(qk_norm=None, learnable_logit_scale=False)).to(mla.kv_b_proj.weight)
    plain.load_state_dict({k: v for k, v in mla.state_dict().items() if not k.startswith(_OURS)})
    return plain


def proxy_calibration(input_norm_weight: torch.Tensor, tokens: int, seed: int = 0) -> torch.Tensor:
    """Stand-in calibration inputs [1, tokens, d] when no real hidden states are at hand: what the
    block's input RMSNorm makes of Gaussian hidden states, gamma ⊙ z / rms(z). Real hidden states
    are not isotropic, so a warm start from these matches the scale only roughly."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(1, tokens, input_norm_weight.shape[0], generator=gen, dtype=torch.float64)
    z = z * z.pow(2).mean(-1, keepdim=True).rsqrt()
    return (z * input_norm_weight.double()).to(input_norm_weight.dtype)


def convert_hf_dir(hf_dir: Union[str, Path], out_dir: Union[str, Path], *, layers=None,
                   qk_norm: Optional[str] = None, warm_start: bool = False, calibration_tokens: int = 512,
                   seed: int = 0, dtype: Optional[torch.dtype] = None, overwrite: bool = False) -> dict:
    """``qkmla convert``: an HF DeepSeek checkpoint directory's attention layers, optionally with a
    QK norm, written with :func:`save_converted`.

    Args:
        layers: None for every layer, an index or several.
        qk_norm: None (plain MLA, the source function) or "rms", "l2", "lp".
        warm_start: set the norm weights with :func:`warm_start_qk_norm` on
            :func:`proxy_calibration` inputs built from each block's ``input_layernorm.weight``.
        overwrite: replace a conversion already in ``out_dir`` (the source is never written).

    Returns:
        {layer: warm-start report} (empty without ``warm_start``).
    """
    if warm_start and qk_norm is None:
        raise ValueError("warm_start: only meaningful with a QK norm (pass qk_norm='rms')")
    if not isinstance(calibration_tokens, int) or isinstance(calibration_tokens, bool) or calibration_tokens < 2:
        raise ValueError(f"calibration_tokens: expected an int >= 2, got {calibration_tokens!r}")
    check_converted_out(out_dir, overwrite, hf_dir)
    if warm_start:  # the causal scores of every head over the calibration tokens are held at once
        heads = read_hf_config(hf_dir).get("num_attention_heads")
        if isinstance(heads, int) and heads > 0:
            check_fits("calibration_tokens", heads * calibration_tokens ** 2 * 2,
                       f"the warm start's scores of {heads} heads over {calibration_tokens} calibration tokens")
    mlas = mla_layers_from_hf_dir(hf_dir, layers, dtype=dtype, qk_norm=qk_norm)
    reports = {}
    if warm_start:
        gammas = read_hf_tensors(hf_dir, [f"model.layers.{i}.input_layernorm.weight" for i in mlas])
        for i, mla in mlas.items():
            gamma = gammas[f"model.layers.{i}.input_layernorm.weight"].to(mla.kv_b_proj.weight)
            x = proxy_calibration(gamma, calibration_tokens, seed + i)
            reports[i] = warm_start_qk_norm(mla, plain_copy(mla), x)
    save_converted(mlas, out_dir, source=str(hf_dir), overwrite=overwrite)
    return reports
