"""HF DeepSeek-V2/V3 attention layers load into MLA and give transformers' outputs, default RoPE and YaRN.

Where the bound comes from. Even for a float64 model, transformers computes its RoPE frequencies
and cos/sin tables in float32 (DeepseekV2 also rotates q and k in float32), and its latent
RMSNorms and eager softmax in float32; qkmla computes all of them in float64. So, in float64:

* transformers as is: the difference is set by the float32 tables. Their error delta
  (max |cos_hf - cos|, |sin_hf - sin| at the positions used; about t_max * 2^-24 per unit of
  angle, 1.1e-6 to 1.7e-6 at t < 48) bounds the relative output difference: the test asserts
  max |MLA - HF| / max |HF| <= 2 delta (measured: 6.4e-7 to 1.7e-6, at most 1.1 delta).
* transformers with those float32 casts lifted (``lift_float32_casts``) and float64 tables
  built from its own frequencies: agreement to float64 roundoff (measured 1.3e-15 to 4.8e-15
  relative; asserted <= 1e-12), explicit path and prefill-then-absorbed-decode alike.
* the frequencies themselves agree to HF's float32 rounding (<= 4 s 2^-24 relative), the cos/sin
  factor and the softmax scale to float64 rounding.
* the fused kernel (float32, Triton's interpreter) against transformers in float64: <= 1e-5.
"""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
v2 = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")

from qkmla import LatentCache  # noqa: E402
from qkmla.integrations.hub.config import load_hf_attention_weights, mla_config_from_hf, mla_from_hf  # noqa: E402

OLD_V2_YARN = tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 16)
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, attn_implementation="eager")
# A small theta puts YaRN's ramp (between beta_fast and beta_slow rotations over L0) inside the 8
# frequency pairs even at this short L0: pairs 0..3 are blended, so truncation and ramp matter.
THETA, L0 = 100.0, 32
T = 48  # positions 0..47 run past L0 = original_max_position_embeddings
ROPES = {
    "default": None,
    # mscale != mscale_all_dim, so both the cos/sin factor (0.9644) and the softmax correction
    # (1.2964) differ from 1; DeepSeek's released configs have mscale == mscale_all_dim
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=L0, beta_fast=32, beta_slow=1,
                 mscale=0.707, mscale_all_dim=1.0),
    # no mscale: plain YaRN, cos/sin factor 0.1 ln 8 + 1, no softmax correction
    "yarn-plain": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=L0),
}
LAYERS = {"v3": (3, {}), "v3-half": (3, {"rope_interleave": False}), "v2": (2, {})}


def hf_layer(version, q_lora_rank, rope=None, **kw):
    """(config, float64 attention layer with norms away from ones, rotary module) of transformers."""
    theta = kw.pop("rope_theta", THETA)
    kw["rope_parameters"] = dict(rope or {"rope_type": "default"}, rope_theta=theta)
    if rope is not None:
        kw["max_position_embeddings"] = int(rope["factor"] * rope["original_max_position_embeddings"])
    cls, mod = (transformers.DeepseekV3Config, v3) if version == 3 else (transformers.DeepseekV2Config, v2)
    cfg = cls(**{**SHAPE, **kw}, q_lora_rank=q_lora_rank)
    attn = (mod.DeepseekV3Attention if version == 3 else mod.DeepseekV2Attention)(cfg, 0).double().eval()
    if version == 2 and rope is not None and OLD_V2_YARN:
        # transformers before 5.16 leaves DeepSeek's YaRN softmax correction out of DeepseekV2Attention
        # (DeepSeek's own code, V3 and qkmla apply it): the reference gets it back.
        attn.scaling = mla_config_from_hf(cfg).scale
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(0.05 * torch.randn_like(p))  # norms away from ones
            if p.dim() == 2:
                p.mul_(4.0)  # logits of a few units, so the softmax is not flat
    rotary = (mod.DeepseekV3RotaryEmbedding if version == 3 else mod.DeepseekV2RotaryEmbedding)(cfg)
    return cfg, attn, rotary


def hf_forward(version, layer, x, position_embeddings):
    T_ = x.shape[1]
    mask = torch.full((T_, T_), float("-inf"), dtype=x.dtype).triu(1)[None, None]
    with torch.no_grad():
        return layer(x, position_embeddings=position_embeddings, attention_mask=mask)[0]


def exact_tables(version, rotary, positions, dtype=torch.float64):
    """transformers' position_embeddings for ``positions``, but computed in float64 from its own
    (float32) frequencies and cos/sin factor."""
    freqs = positions[..., None].double() * rotary.inv_freq.double()
    m = rotary.attention_scaling
    if version == 2:
        return torch.polar(torch.full_like(freqs, m), freqs)  # complex128
    emb = torch.cat((freqs, freqs), -1)
    return (emb.cos() * m).to(dtype), (emb.sin() * m).to(dtype)


def table_error(version, tables, rotary, positions) -> float:
    """max |HF's float32 cos/sin table - the float64 one| (qkmla's frequencies and factor)."""
    angles = positions[..., None].double() * rotary.inv_freq
    m = rotary.attention_factor
    if version == 2:
        return float((tables.to(torch.complex128) - torch.polar(torch.full_like(angles, m), angles)).abs().max())
    cos, sin = (t[..., :angles.shape[-1]].double() for t in tables)
    return max(float((cos - angles.cos() * m).abs().max()), float((sin - angles.sin() * m).abs().max()))


def _rms_norm64(self, hidden_states):
    """DeepseekV2/V3RMSNorm.forward without its cast to float32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _eager64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager_attention_forward with the softmax in the inputs' dtype (not float32)."""
    key, value = v3.repeat_kv(key, module.num_key_value_groups), v3.repeat_kv(value, module.num_key_value_groups)
    weights = (torch.matmul(query, key.transpose(2, 3)) * scaling + attention_mask).softmax(-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _v2_rotary64(xq, xk, freqs_cis):
    """DeepseekV2's apply_rotary_emb without its cast of q and k to float32."""
    def rotate(x):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * freqs_cis.unsqueeze(1)).flatten(3)
    return rotate(xq), rotate(xk)


def lift_float32_casts(monkeypatch):
    """transformers computes latent RMSNorms and the softmax in float32 even for a float64 model,
    and DeepSeek-V2 its RoPE too; these patches keep its arithmetic otherwise as is."""
    for mod, norm in ((v3, v3.DeepseekV3RMSNorm), (v2, v2.DeepseekV2RMSNorm)):
        monkeypatch.setattr(norm, "forward", _rms_norm64)
        monkeypatch.setattr(mod, "eager_attention_forward", _eager64)
    monkeypatch.setattr(v2, "apply_rotary_emb", _v2_rotary64)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


CASES = [pytest.param(layer, q, rope, id=f"{layer}-q{q}-{rope}")
         for layer in LAYERS for q in (32, None) for rope in ROPES]


@pytest.mark.parametrize("layer_name,q_lora_rank,rope", CASES)
def test_outputs_match_hf(layer_name, q_lora_rank, rope, monkeypatch):
    """Explicit path and prefill-then-absorbed-decode against transformers, past L0 for YaRN."""
    version, extra = LAYERS[layer_name]
    _, layer, rotary = hf_layer(version, q_lora_rank, ROPES[rope], **extra)
    x = torch.randn(2, T, 64, dtype=torch.float64)
    pos = torch.arange(T)[None].expand(2, T)
    mla = mla_from_hf(layer).eval()
    assert mla.config.scale == pytest.approx(layer.scaling, rel=1e-15)

    # 1. transformers' arithmetic in float64 (its float32 casts lifted, float64 tables from its own
    #    frequencies): agreement to float64 roundoff.
    with torch.no_grad(), monkeypatch.context() as patch:
        lift_float32_casts(patch)
        mla.rotary.inv_freq.copy_(rotary.inv_freq.double())
        ref = hf_forward(version, layer, x, exact_tables(version, rotary, pos))
        assert rel(mla(x), ref) <= 1e-12
        cache = LatentCache.from_config(mla.config, 2, T, dtype=torch.float64)
        got = torch.cat([mla(x[:, :T // 2], cache)] + [mla(x[:, t:t + 1], cache) for t in range(T // 2, T)], 1)
        assert rel(got, ref) <= 1e-12

    # 2. transformers as is (its float32 tables), qkmla with its own float64 frequencies.
    mla = mla_from_hf(layer).eval()
    with torch.no_grad():
        tables = rotary(x, pos)
        ref = hf_forward(version, layer, x, tables)
        err = rel(mla(x), ref)
        cache = LatentCache.from_config(mla.config, 2, T, dtype=torch.float64)
        got = torch.cat([mla(x[:, :T // 2], cache)] + [mla(x[:, t:t + 1], cache) for t in range(T // 2, T)], 1)
        err = max(err, rel(got, ref))
    delta = table_error(version, tables, mla.rotary, pos)
    assert 0 < delta < 1e-5 and err <= 2 * delta, f"relative error {err:.2e}, float32 table error {delta:.2e}"

    # 3. The test can fail: the wrong layout, a dropped softmax correction or cos/sin factor.
    with torch.no_grad():
        wrong = mla_from_hf(layer, rope_interleave=not mla.config.rope_interleave)
        assert rel(wrong(x), ref) > 1e-3
        if ROPES[rope] is not None:
            if mla.config.rope_scaling.softmax_scale_factor != 1.0:
                assert rel(mla_from_hf(layer, softmax_scale=mla.config.qk_head_dim ** -0.5)(x), ref) > 1e-3
            unscaled = mla_from_hf(layer, rope_scaling=None)  # YaRN frequencies dropped
            assert rel(unscaled(x), ref) > 1e-3
            plain = mla_from_hf(layer)
            plain.rotary.attention_factor = 1.0
            assert rel(plain(x), ref) > 1e-3


@pytest.mark.parametrize("layer_name", ["v3", "v3-half", "v2"])
def test_yarn_frequencies_and_scales_match_hf(layer_name):
    """Frequencies to float32 rounding, cos/sin factor and softmax scale to float64 rounding, at
    DeepSeek's width (d_r = 64, theta = 1e4, L0 = 4096: the ramp spans pairs 10..23)."""
    version, extra = LAYERS[layer_name]
    deepseek = dict(rope_type="yarn", factor=40.0, mscale=0.707, mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
                    original_max_position_embeddings=4096)
    for rope in (deepseek, ROPES["yarn"], ROPES["yarn-plain"], dict(deepseek, truncate=False, mscale=1.0)):
        _, layer, rotary = hf_layer(version, 32, rope, qk_rope_head_dim=64, rope_theta=10000.0, **extra)
        mla = mla_from_hf(layer)
        ours = mla.rotary.inv_freq
        # HF's float32 ramp r carries 2^-24-sized errors, which w = (1 - r) w / s + r w scales by up to s
        assert float(((ours - rotary.inv_freq.double()) / ours).abs().max()) <= 4 * rope["factor"] * 2.0 ** -24
        assert mla.rotary.attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-15)
        assert mla.config.scale == pytest.approx(layer.scaling, rel=1e-15)
    # the ramp is really used: some frequencies interpolated (w / s), some kept, some in between
    ratio = ours / (1.0 / 10000.0 ** (torch.arange(0, 64, 2).double() / 64))
    assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(1 / 40) and ((ratio > 0.03) & (ratio < 0.99)).sum() >= 10


def test_deepseek_v3_softmax_scale():
    """DeepSeek-V3's released config: tau = 192^-1/2 * (0.1 ln 40 + 1)^2, cos/sin factor 1."""
    cfg = mla_config_from_hf(transformers.DeepseekV3Config(rope_scaling=dict(
        type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
        original_max_position_embeddings=4096), max_position_embeddings=163840))
    assert cfg.scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-15)
    assert cfg.rope_scaling.cos_sin_factor == 1.0 and cfg.rope_interleave


@pytest.mark.parametrize("layer_name", ["v3", "v3-half"])
def test_triton_kernel_path_matches_hf(layer_name):
    """Absorbed decode through the fused kernel (Triton's interpreter on CPU), YaRN past L0."""
    pytest.importorskip("triton")
    version, extra = LAYERS[layer_name]
    _, layer, rotary = hf_layer(version, 32, ROPES["yarn"], **extra)
    x = torch.randn(2, 40, 64, dtype=torch.float64)
    pos = torch.arange(40)[None].expand(2, 40)
    ref = hf_forward(version, layer, x, rotary(x, pos))
    mla = mla_from_hf(layer, decode_backend="triton").float().eval()
    cache = LatentCache.from_config(mla.config, 2, 48, fill=float("nan"))
    xf = x.float()
    with torch.no_grad():
        got = torch.cat([mla(xf[:, :34], cache)] + [mla(xf[:, t:t + 1], cache) for t in range(34, 40)], 1)
    err = rel(got.double()[:, 34:], ref[:, 34:])
    assert err <= 1e-5, err  # float32 kernel and weights
    mla_plain_tau = mla_from_hf(layer, softmax_scale=mla.config.qk_head_dim ** -0.5,
                                decode_backend="triton").float().eval()
    cache = LatentCache.from_config(mla.config, 2, 48, fill=float("nan"))
    with torch.no_grad():
        bad = torch.cat([mla_plain_tau(xf[:, :34], cache)] + [mla_plain_tau(xf[:, t:t + 1], cache)
                                                              for t in range(34, 40)], 1)
    assert rel(bad.double()[:, 34:], ref[:, 34:]) > 1e-3  # the kernel really uses the corrected tau


def test_qk_norm_can_start_from_hf_weights():
    _, layer, _ = hf_layer(3, 32)
    mla = mla_from_hf(layer, qk_norm="rms")
    assert mla.config.qk_norm.kind == "rms"
    torch.testing.assert_close(mla.kv_b_proj.weight, layer.kv_b_proj.weight)
    assert torch.equal(mla.q_norm.content.weight, torch.ones(16, dtype=torch.float64))


def test_whole_model_state_dict_with_prefix_and_errors():
    _, layer, _ = hf_layer(3, 32)
    sd = {f"model.layers.5.self_attn.{k}": v for k, v in layer.state_dict().items()}
    mla = mla_from_hf(layer)
    other = type(mla)(mla.config).double()
    load_hf_attention_weights(other, sd, prefix="model.layers.5.self_attn.")
    torch.testing.assert_close(other.q_b_proj.weight, layer.q_b_proj.weight)
    with pytest.raises(ValueError, match="missing"):
        load_hf_attention_weights(other, sd, prefix="model.layers.6.self_attn.")
    bad = dict(sd)
    bad["model.layers.5.self_attn.kv_b_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="kv_b_proj.weight"):
        load_hf_attention_weights(other, bad, prefix="model.layers.5.self_attn.")


def test_bad_hf_configs():
    base = dict(SHAPE, model_type="deepseek_v3", q_lora_rank=32, max_position_embeddings=64)
    base.pop("attn_implementation")
    assert mla_config_from_hf(base).rope_scaling is None  # a config.json dict works too
    with pytest.raises(ValueError, match="rope_type 'linear'.*allowed"):
        mla_config_from_hf(dict(base, rope_scaling={"type": "linear", "factor": 2.0}))
    with pytest.raises(ValueError, match="rope_type 'dynamic'"):
        mla_config_from_hf(transformers.DeepseekV3Config(**SHAPE, q_lora_rank=32, rope_parameters={
            "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}))
    with pytest.raises(ValueError, match="model_type"):
        mla_config_from_hf(dict(base, model_type="llama"))
    with pytest.raises(ValueError, match="model_type"):
        mla_config_from_hf(transformers.LlamaConfig())
    with pytest.raises(ValueError, match="'factor'"):
        mla_config_from_hf(dict(base, rope_scaling={"type": "yarn", "original_max_position_embeddings": 16}))
    with pytest.raises(ValueError, match="factor"):
        mla_config_from_hf(dict(base, rope_scaling={"type": "yarn", "factor": 0.5}))
    with pytest.raises(ValueError, match="unknown YaRN keys.*'mscale_all_dims'"):
        mla_config_from_hf(dict(base, rope_scaling={"type": "yarn", "factor": 4.0, "mscale_all_dims": 1.0}))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_config_from_hf({k: v for k, v in base.items() if k != "kv_lora_rank"})


def test_a_recorded_qk_norm_and_kv_groups_are_read_and_not_contradicted():
    """Issue 52, point 2: a config qkmla saved records its QK norm and KV groups ("qkmla",
    integrations.hub.record); the config built from it has them, and an override that
    contradicts the record is refused naming it (a plain config still gives plain MLA)."""
    from qkmla import QKNormConfig

    base = dict(SHAPE, model_type="deepseek_v3", q_lora_rank=32, max_position_embeddings=64)
    base.pop("attn_implementation")
    assert mla_config_from_hf(base).qk_norm is None and mla_config_from_hf(base, qk_norm="rms").qk_norm.kind == "rms"
    saved = dict(base, qkmla={"qk_norm": QKNormConfig("l2", mode="unified").record(), "num_kv_groups": 2})
    config = mla_config_from_hf(saved)
    assert config.qk_norm == QKNormConfig("l2", mode="unified") and config.num_kv_groups == 2
    assert mla_config_from_hf(saved, qk_norm=QKNormConfig("l2", mode="unified")) == config
    assert mla_config_from_hf(dict(base, qkmla={"qk_norm": "rms"})).qk_norm == QKNormConfig("rms")  # flat record
    with pytest.raises(ValueError, match=r"qk_norm: hf_config records the QK norm l2 unified in its 'qkmla' entry "
                                         r"\(a checkpoint qkmla saved, .*\), but no QK norm was asked for"):
        mla_config_from_hf(saved, qk_norm=None)
    with pytest.raises(ValueError, match=r"num_kv_groups: hf_config records 2 KV groups in its 'qkmla' entry"):
        mla_config_from_hf(saved, num_kv_groups=4)
    with pytest.raises(ValueError, match=r"hf_config: its 'qkmla' entry is not valid: qk_norm"):
        mla_config_from_hf(dict(base, qkmla={"qk_norm": "rmsnorm"}))
