"""Load HF DeepSeek-V2/V3 attention weights into MLA and match the HF layer's outputs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
v2 = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")

from qkmla import LatentCache  # noqa: E402
from qkmla.interop import load_hf_attention_weights, mla_config_from_hf, mla_from_hf  # noqa: E402

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, attn_implementation="eager")


def hf_layer(version, q_lora_rank, **kw):
    if version == 3:
        cfg = transformers.DeepseekV3Config(**SHAPE, q_lora_rank=q_lora_rank, **kw)
        return cfg, v3.DeepseekV3Attention(cfg, 0).eval(), v3.DeepseekV3RotaryEmbedding(cfg)
    cfg = transformers.DeepseekV2Config(**SHAPE, q_lora_rank=q_lora_rank, **kw)
    return cfg, v2.DeepseekV2Attention(cfg, 0).eval(), v2.DeepseekV2RotaryEmbedding(cfg)


def hf_forward(version, layer, rotary, x):
    B, T = x.shape[:2]
    pos = torch.arange(T)[None].expand(B, T)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        if version == 3:
            return layer(x, position_embeddings=rotary(x, pos), attention_mask=mask)[0]
        return layer(x, attention_mask=mask, position_embeddings=rotary(x, pos))[0]


@pytest.mark.parametrize("q_lora_rank", [32, None])
@pytest.mark.parametrize("version,extra", [(3, {}), (3, {"rope_interleave": False}), (2, {})])
def test_outputs_match_hf(version, extra, q_lora_rank):
    cfg, layer, rotary = hf_layer(version, q_lora_rank, **extra)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms away from ones
    x = torch.randn(2, 13, 64)
    ref = hf_forward(version, layer, rotary, x)
    mla = mla_from_hf(layer).eval()
    with torch.no_grad():
        torch.testing.assert_close(mla(x), ref, rtol=1e-5, atol=1e-5)
        # ... and the latent cache decodes the same outputs token by token
        cache = LatentCache.from_config(mla.config, 2, 13)
        got = torch.cat([mla(x[:, :7], cache)] + [mla(x[:, t:t + 1], cache) for t in range(7, 13)], 1)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        # the wrong RoPE layout is detected: this test can fail
        wrong = mla_from_hf(layer, rope_interleave=not mla.config.rope_interleave)
        assert (wrong(x) - ref).abs().max() > 1e-3


def test_qk_norm_can_start_from_hf_weights():
    _, layer, _ = hf_layer(3, 32)
    mla = mla_from_hf(layer, qk_norm="rms")
    assert mla.config.qk_norm == "rms"
    torch.testing.assert_close(mla.kv_b_proj.weight, layer.kv_b_proj.weight)
    assert torch.equal(mla.q_norm.content.weight, torch.ones(16))


def test_whole_model_state_dict_with_prefix_and_errors():
    cfg, layer, _ = hf_layer(3, 32)
    sd = {f"model.layers.5.self_attn.{k}": v for k, v in layer.state_dict().items()}
    mla = mla_from_hf(layer)
    other = type(mla)(mla.config)
    load_hf_attention_weights(other, sd, prefix="model.layers.5.self_attn.")
    torch.testing.assert_close(other.q_b_proj.weight, layer.q_b_proj.weight)
    with pytest.raises(ValueError, match="missing"):
        load_hf_attention_weights(other, sd, prefix="model.layers.6.self_attn.")
    bad = dict(sd)
    bad["model.layers.5.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="kv_b_proj.weight"):
        load_hf_attention_weights(other, bad, prefix="model.layers.5.self_attn.")
    with pytest.raises(ValueError, match="rope_type"):
        mla_config_from_hf(transformers.DeepseekV3Config(**SHAPE, q_lora_rank=32, rope_parameters={
            "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 64}))
