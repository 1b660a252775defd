"""The QK-normed layer's forward (``attention.py``), built through vLLM's pluggable MLA layer from
vLLM's own constructor arguments, without an engine: what a CUDA graph captures of it (everything
but the attention op, which vLLM runs outside its piecewise graphs) reads nothing from the device."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("vllm")

from qkmla import QKNormConfig  # noqa: E402

H, D_N, D_R, D_V, D_C, HIDDEN, T = 4, 16, 64, 16, 512, 64, 5


class Projection(nn.Linear):
    """Stands for vLLM's unquantized linear layers (``quant_method`` None, output and bias returned),
    which need a tensor-parallel group to be built."""

    quant_method = None

    def forward(self, x):
        return super().forward(x), None


class Rotary(nn.Module):
    """Stands for vLLM's rotary embedding (its ``forward_native``, which the layer calls)."""

    def forward_native(self, positions, q, k):
        return q.flip(-1), k.flip(-1)


def layer(norm: QKNormConfig):
    """One QK-normed layer, as vLLM's DeepSeek attention builds its MLA layer inside
    ``qk_normed_mla_layers`` (no q-LoRA), its weights processed as vLLM processes them after loading."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    from qkmla.integrations.vllm.attention import qk_normed_mla_layers
    from qkmla.integrations.vllm.backend import cpu_backend

    def linear(n_in, n_out):
        return Projection(n_in, n_out, bias=False)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        modules = SimpleNamespace(fused_qkv_a_proj=None, kv_a_proj_with_mqa=linear(HIDDEN, D_C + D_R),
                                  q_a_layernorm=None, q_b_proj=None, q_proj=linear(HIDDEN, H * (D_N + D_R)),
                                  kv_a_layernorm=nn.RMSNorm(D_C), kv_b_proj=linear(D_C, H * (D_N + D_V)),
                                  rotary_emb=Rotary(), o_proj=linear(H * D_V, HIDDEN), indexer=None, is_sparse=False)
        with qk_normed_mla_layers(norm, cpu_backend(), "auto") as cls:
            built = cls(hidden_size=HIDDEN, num_heads=H, scale=0.1, qk_nope_head_dim=D_N, qk_rope_head_dim=D_R,
                        v_head_dim=D_V, q_lora_rank=None, kv_lora_rank=D_C, mla_modules=modules, cache_config=None,
                        prefix="model.layers.0.self_attn")
        built.mla_attn.process_weights_after_loading(torch.float32)  # vLLM's W_UK_T, then the layer's prepare()
    return built


@pytest.mark.parametrize("norm", [QKNormConfig("rms", learnable_logit_scale=True), QKNormConfig("l2", mode="content"),
                                  QKNormConfig("lp", mode="unified", p=3.0)], ids=["rms", "l2-content", "lp3-unified"])
def test_the_layers_forward_reads_nothing_from_the_device(norm):
    """Under FakeTensorMode (no tensor holds data: .item(), .tolist() or an output shape read from
    the values raises) the forward runs whole, norms, logit scale and key scalars included (formed
    here in unified mode, at the cache write otherwise), and hands vLLM's MLAAttention the query,
    the latent and the RoPE key, with the scalars appended where it formed them."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    built = layer(norm)
    handed = []

    def attention(q, c, k_pe, output_shape):  # vLLM's MLAAttention (the cache write, prefill, decode)
        handed.append((tuple(q.shape), tuple(c.shape), tuple(k_pe.shape)))
        return torch.zeros(output_shape)
    built.mla_attn.forward = attention
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = built(torch.empty(T, dtype=torch.int64), torch.empty(T, HIDDEN))
    assert out.shape == (T, HIDDEN)
    scalars = 0 if built.scalars_at_write else H
    assert built.scalars_at_write == (norm.mode != "unified")
    assert handed == [((T, H, D_N + D_R), (T, D_C), (T, 1, D_R + scalars))]
    with FakeTensorMode(), pytest.raises(DataDependentOutputException):  # what a read of the device meets
        torch.empty(T).sum().item()
