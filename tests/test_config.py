import pytest

from qkmla import MLA_PRESETS, AttentionConfig, MLAConfig, mla_preset


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(num_heads=6, num_kv_groups=4), "num_kv_groups"),
        (dict(qk_norm="lp", qk_norm_p=0.5), "qk_norm_p"),
        (dict(qk_norm_eps=-1e-6), "qk_norm_eps"),
        (dict(qk_norm="layernorm"), "qk_norm"),
        (dict(qk_norm_mode="fused"), "qk_norm_mode"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(q_lora_rank=-3), "q_lora_rank"),
        (dict(hidden_size=64.0), "hidden_size"),
        (dict(softmax_scale=0.0), "softmax_scale"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(softmax_scale=float("inf")), "softmax_scale: expected a finite positive number"),
        (dict(latent_norm_eps=float("inf")), "latent_norm_eps: expected a finite number"),
        (dict(rope_theta=float("inf")), "rope_theta"),
    ],
)
def test_invalid_mla_config_names_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        MLAConfig(**kwargs)


def test_invalid_norm_lists_allowed_values():
    with pytest.raises(ValueError, match=r"\(None, 'rms', 'l2', 'lp'\)"):
        MLAConfig(qk_norm="RMS")


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(hidden_size=60, num_heads=8), "head_dim"),
        (dict(head_dim=9), "head_dim"),
        (dict(qk_norm="lp", qk_norm_p=0.9), "qk_norm_p"),
    ],
)
def test_invalid_attention_config(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        AttentionConfig(**kwargs)


def test_presets_have_published_shapes():
    v3 = mla_preset("deepseek-v3")
    assert (v3.hidden_size, v3.num_heads, v3.q_lora_rank, v3.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (v3.qk_nope_head_dim, v3.qk_rope_head_dim, v3.v_head_dim) == (128, 64, 128)
    tp8 = mla_preset("deepseek-v3-tp8")
    assert tp8.num_heads == 16 and tp8.num_kv_groups == 16
    assert mla_preset("deepseek-v2-lite").q_lora_rank is None
    assert set(MLA_PRESETS) >= {"tiny", "deepseek-v2-lite", "deepseek-v3", "deepseek-v3-tp8"}
    assert mla_preset("tiny", qk_norm="l2").qk_norm == "l2"
    with pytest.raises(ValueError, match="preset"):
        mla_preset("deepseek-v4")


def test_default_scale_is_tau():
    cfg = MLAConfig()
    assert cfg.scale == pytest.approx((cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)
    assert MLAConfig(softmax_scale=3.0).scale == 3.0
