"""DeepSeek-V3-shaped torchtitan model configs that export: what qkmla's recipes train.

torchtitan's own flavors (debugmodel, 16B, 236B) route by softmax and build the latent norms with
eps 1e-5, which transformers' DeepSeek-V3 computes otherwise (``checkpoint.py``): a model trained
from them cannot be served as it was trained. These flavors have DeepSeek-V3's router (sigmoid,
group-limited top-k, normalized, scaled) and latent norms at eps 1e-6, and are built from torchtitan's
own layer builder (``build_mla_moe_layers``) with DeepSeek-V3's initialization as torchtitan sets it.
Byte vocabulary (256): the embedded Shakespeare needs no tokenizer.

    flavor  dim  layers (dense)  heads  d_c  d_n/d_r/d_v  experts (top-k, shared)  params
    cpu     256   4 (1)            8    128   64/32/64      8 (2, 1)                 ~5.6M
    h200   2048  16 (1)           16    512  128/64/128    16 (2, 1)                 ~1.9B
"""

from __future__ import annotations

import dataclasses
from functools import partial

from .versions import check_torchtitan

check_torchtitan()

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.param_init import depth_scaled_std  # noqa: E402
from torchtitan.models.deepseek_v3 import DeepSeekV3Model, build_mla_moe_layers  # noqa: E402

VOCAB = 256  # bytes
FLAVORS = {
    "cpu": dict(dim=256, n_layers=4, n_heads=8, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
                v_head_dim=64, dense_hidden_dim=1024, moe_hidden_dim=128, num_experts=8, groups=(4, 2),
                max_seq_len=1024),
    "h200": dict(dim=2048, n_layers=16, n_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, dense_hidden_dim=8192, moe_hidden_dim=1024, num_experts=16, groups=(4, 2),
                 max_seq_len=4096),
}
LATENT_EPS = 1e-6  # what transformers' DeepSeek-V3 builds its latent norms with

_LINEAR = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}


def _depth(layer_id: int) -> dict:
    return {"weight": partial(nn.init.trunc_normal_, std=depth_scaled_std(0.02, layer_id)), "bias": nn.init.zeros_}


def _depth_experts(layer_id: int) -> dict:
    std = depth_scaled_std(0.02, layer_id)
    return {"w1_EFD": partial(nn.init.trunc_normal_, std=0.02), "w2_EDF": partial(nn.init.trunc_normal_, std=std),
            "w3_EFD": partial(nn.init.trunc_normal_, std=std)}


def model_config(flavor: str = "cpu") -> DeepSeekV3Model.Config:
    """The flavor's torchtitan ``DeepSeekV3Model.Config`` (FlexAttention inside: set another inner
    attention, e.g. ``inner.DenseMaskAttention`` on a CPU, before building)."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor: expected one of {sorted(FLAVORS)}, got {flavor!r}")
    f = dict(FLAVORS[flavor])
    groups, max_seq_len = f.pop("groups"), f.pop("max_seq_len")
    dim = f["dim"]
    layers = build_mla_moe_layers(
        **f, n_dense_layers=1, q_lora_rank=0, mscale=1.0, num_shared_experts=1, router_top_k=2,
        router_score_func="sigmoid", router_num_expert_groups=groups[0], router_num_limited_groups=groups[1],
        router_route_scale=2.5, router_route_norm=True, attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None, linear_init=_LINEAR, norm_init={"weight": nn.init.ones_},
        depth_init=_depth, depth_experts_init=_depth_experts,
        rope=ComplexRoPE.Config(dim=f["qk_rope_head_dim"], max_seq_len=max_seq_len, theta=10000.0))
    for layer in layers:
        a = layer.attention
        layer.attention = dataclasses.replace(a, kv_norm=dataclasses.replace(a.kv_norm, eps=LATENT_EPS),
                                              q_norm=dataclasses.replace(a.q_norm, eps=LATENT_EPS))
    s = dim ** -0.5
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=dim, layers=layers, norm=RMSNorm.Config(normalized_shape=dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=1.0)}),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                              param_init={"weight": partial(nn.init.trunc_normal_, std=s, a=-3 * s, b=3 * s)}))


def materialize(config, device="cpu", seed: int = 0):
    """A model built from a torchtitan model ``config`` as torchtitan's Trainer builds one: on the meta
    device, then allocated on ``device`` and initialized by torchtitan's ``init_states`` (qkmla's
    layers set their own weights there), from ``seed``."""
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
    return model
