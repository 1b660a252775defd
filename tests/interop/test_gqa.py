"""``convert_gqa``: a random-weight transformers Qwen3 model converted to a DeepSeek-V3-architecture
model with qkmla's content-mode QK norm (MATH.md, "Content variant"), checked against the source.

transformers computes RMSNorms and RoPE tables in float32 even in a float64 model; the float64
comparisons lift those casts (``exact_float64``) in both the source and the converted model, so
what remains is float64 roundoff plus the constant latent channel's bound (report.scale_bound,
<= 2^-41 = 4.5e-13 relative).
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3 as qwen3  # noqa: E402

from qkmla.interop import from_pretrained, latent_layers  # noqa: E402
from qkmla.interop.gqa import convert_gqa  # noqa: E402

from .test_hf_model import max_rel, stepwise_logits  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             head_dim=16, max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
# Qwen3-0.6B's attention widths, two layers and a small vocabulary
QWEN3_06B = dict(vocab_size=128, hidden_size=1024, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})


def _rms_norm64(self, hidden_states):
    """Qwen3RMSNorm / DeepseekV3RMSNorm.forward without the cast to float32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary64(self, x, position_ids):
    """Qwen3RotaryEmbedding.forward with float64 frequencies and tables."""
    D = self.config.head_dim
    inv_freq = 1.0 / (self.config.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


@pytest.fixture
def exact_float64(monkeypatch):
    for norm in (qwen3.Qwen3RMSNorm, v3.DeepseekV3RMSNorm):
        monkeypatch.setattr(norm, "forward", _rms_norm64)
    monkeypatch.setattr(qwen3.Qwen3RotaryEmbedding, "forward", _rotary64)


def qwen3_model(seed: int = 0, dtype=torch.float64, **shape):
    """A random Qwen3ForCausalLM with its QK-norm and layer-norm weights away from ones."""
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**{**SMALL, **shape}, attn_implementation="sdpa")
    model = transformers.Qwen3ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(0.5 + torch.rand_like(p))
            elif "self_attn" in name:
                p.mul_(3.0)
    return model


def prompt(model, B: int = 2, T: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, T), generator=g)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("rope_dim", [None, 8])
def test_one_kv_head_full_rank_is_the_source_to_roundoff(exact_float64, rope_dim):
    """G = 1, latent of full rank. Every RoPE pair kept (rope_dim None = D): the logits are the source's
    to float64 roundoff plus the constant-channel bound; greedy tokens through the latent cache too.
    Half the pairs kept ("uniform"): the others lose their rotation, an approximation the report names."""
    src = qwen3_model(num_key_value_heads=1)
    dst, report = convert_gqa(src, rope_dim=rope_dim)
    assert report.num_kv_groups == 1 and report.rank == report.max_rank == 32 and report.kv_lora_rank == 33
    assert report.scale_bound < 4.6e-13  # 2^-41 plus the latent norm eps term
    ids = prompt(src)
    err = max_rel(logits(dst, ids), logits(src, ids))
    print(f"G=1 rope_dim={rope_dim}: max |logit error| / max |logit| = {err:.3g}")
    if rope_dim is None:
        assert err < 1e-11, err
        assert not any("RoPE pairs" in a or "RoPE key" in a for a in report.approximate)
    else:
        assert err > 1e-3 and any("4 of 8 RoPE pairs are not rotated" in a for a in report.approximate), err
    steps, fed = stepwise_logits(dst, ids, 6)
    full = logits(src, torch.cat((ids, fed), dim=1))
    for i, step in enumerate(steps):
        assert max_rel(step, full[:, ids.shape[1] - 1 + i]) < (1e-11 if rope_dim is None else 1.0)
    if rope_dim is None:
        with torch.no_grad():
            want = src.generate(ids, max_new_tokens=8, do_sample=False)
            got = dst.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(got, want)
