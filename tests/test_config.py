import dataclasses

import pytest

from qkmla import AttentionConfig, MLAConfig, MLA_PRESETS, QKNormConfig, mla_preset


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
        (dict(num_heads=6, num_kv_groups=4), "num_kv_groups"),
        (dict(qk_norm="layernorm"), "qk_norm"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(q_lora_rank=-3), "q_lora_rank"),
        (dict(hidden_size=64.0), "hidden_size"),
        (dict(softmax_scale=0.0), "softmax_scale"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(softmax_scale=float("inf")), "softmax_scale: expected a positive number within float32's normal"),
        # finite in Python, inf (and 0) in the float32 logits they scale: NaN from the first forward
        (dict(softmax_scale=1e300),
         r"softmax_scale: .*\(1\.1754943508222875e-38 to 3\.4028234663852886e\+38\) or None, got 1e\+300"),
        (dict(softmax_scale=1e-320), "softmax_scale: expected a positive number within float32's normal"),
        (dict(latent_norm_eps=float("inf")), "latent_norm_eps: expected a finite number"),
        (dict(rope_theta=float("inf")), "rope_theta"),
    ],
)
def test_invalid_mla_config_names_the_argument(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        MLAConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(kind="lp", p=0.5), "p: expected a finite number >= 1 and <= 100"),
        (dict(kind="lp", p=0.9), "p: expected a finite number >= 1 and <= 100"),
        (dict(eps=-1e-6), "eps: expected a finite number >= 0"),
        (dict(kind="layernorm"), r"kind: expected one of \(None, 'rms', 'l2', 'lp'\)"),
        (dict(mode="fused"), r"mode: expected one of \('blockwise', 'unified', 'content'\)"),
        (dict(scope="heads"), r"scope: expected one of \('head', 'projection'\)"),
        (dict(learnable_logit_scale=1), "learnable_logit_scale: expected True or False"),
        (dict(kind=None, p=3.0), "p: only read with a norm"),
    ],
)
def test_invalid_qk_norm_config_names_the_field(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        QKNormConfig(**kwargs)


def test_the_qk_norm_travels_as_one_value():
    """A kind name, a dict of the fields (a saved config, a checkpoint's record) and the value itself
    give the same QKNormConfig; no norm and a fixed scale is None."""
    lp = QKNormConfig("lp", mode="unified", p=3.0)
    assert MLAConfig(qk_norm="l2").qk_norm == QKNormConfig("l2") and MLAConfig().qk_norm == QKNormConfig()
    assert QKNormConfig.of(lp.record()) == lp and MLAConfig(qk_norm=lp.record()).qk_norm == lp
    assert MLAConfig(qk_norm=None).qk_norm is None and MLAConfig(qk_norm=QKNormConfig(None)).qk_norm is None
    plain_learned = MLAConfig(qk_norm=QKNormConfig(None, learnable_logit_scale=True))
    assert plain_learned.learnable_logit_scale and not plain_learned.has_qk_norm and plain_learned.num_key_scalars == 0
    cfg = MLAConfig(qk_norm=lp, num_kv_groups=2)
    assert MLAConfig(**dataclasses.asdict(cfg)) == cfg  # a config saved as a dict loads back
    assert lp.name == "lp(p=3) unified" and QKNormConfig(scope="projection").name == "rms blockwise over the projection"
    with pytest.raises(ValueError, match=r"qk_norm: unknown fields \['kind_'\]"):
        MLAConfig(qk_norm={"kind_": "rms"})
    with pytest.raises(ValueError, match="qk_norm: expected a QKNormConfig"):
        MLAConfig(qk_norm=2.0)


def test_invalid_norm_lists_allowed_values():
    with pytest.raises(ValueError, match=r"\(None, 'rms', 'l2', 'lp'\)"):
        MLAConfig(qk_norm="RMS")


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(hidden_size=60, num_heads=8), "head_dim"),
        (dict(head_dim=9), "head_dim"),
        (dict(qk_norm=QKNormConfig(mode="unified")), "qk_norm: a head without content and RoPE blocks"),
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
    assert mla_preset("tiny", qk_norm="l2").qk_norm == QKNormConfig("l2")
    with pytest.raises(ValueError, match="preset"):
        mla_preset("deepseek-v4")


def test_default_scale_is_tau():
    cfg = MLAConfig()
    assert cfg.scale == pytest.approx((cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)
    assert MLAConfig(softmax_scale=3.0).scale == 3.0
