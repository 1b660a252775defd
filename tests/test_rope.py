import dataclasses
import math

import pytest
import torch

from qkmla import MLA, MLAConfig
from qkmla.rope import RotaryEmbedding, YarnScaling, yarn_get_mscale


@pytest.mark.parametrize("interleave", [True, False])
def test_rope_is_relative(interleave):
    """<RoPE_m(q), RoPE_n(k)> depends only on m - n, and rotations keep norms."""
    rope = RotaryEmbedding(16, interleave=interleave)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def dot(m, n):
        return (rope(q, torch.tensor([[m]])) * rope(k, torch.tensor([[n]]))).sum()

    torch.testing.assert_close(dot(7, 3), dot(104, 100))
    torch.testing.assert_close(rope(q, torch.tensor([[5]])).norm(), q.norm())


def test_interleaved_matches_complex_rotation():
    """DeepSeek-V2's reference: view pairs as complex numbers and multiply by e^{i t w}."""
    rope = RotaryEmbedding(8, theta=10000.0, interleave=True)
    x = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    pos = torch.arange(5).expand(2, 5)
    freqs = pos[..., None].double() * rope.inv_freq
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(2, 5, 3, 4, 2)) * torch.polar(torch.ones_like(freqs), freqs)[:, :, None])
    torch.testing.assert_close(rope(x, pos), ref.flatten(-2))


def test_odd_dim_rejected():
    with pytest.raises(ValueError, match="dim"):
        RotaryEmbedding(7)


# -- YaRN ---------------------------------------------------------------------------------------

DEEPSEEK_V3_YARN = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}


def test_yarn_frequencies_blend_along_the_ramp():
    """Pairs that turn more than beta_fast times over L0 keep w_k, fewer than beta_slow get w_k / s,
    a linear ramp over k in between (the ramp's ends rounded outwards with truncate)."""
    y = YarnScaling(factor=40.0, original_max_position_embeddings=4096)
    base = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ratio = y.inv_freq(64, 10000.0) / base  # 1 (kept) ... 1/40 (interpolated)
    low = math.floor(64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(10000.0)))   # 10
    high = math.ceil(64 * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(10000.0)))   # 23
    ramp = ((torch.arange(32, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    torch.testing.assert_close(ratio, (1 - ramp) + ramp / 40, rtol=1e-15, atol=0)
    assert (low, high) == (10, 23) and ratio[:low + 1].eq(1).all()
    torch.testing.assert_close(ratio[high:], torch.full((32 - high,), 1 / 40, dtype=torch.float64))


def test_yarn_factors():
    """cos/sin factor mscale(s, mscale) / mscale(s, mscale_all_dim), or 0.1 ln s + 1 without them;
    softmax factor mscale(s, mscale_all_dim)^2; s <= 1 changes nothing."""
    ds = YarnScaling.from_dict(DEEPSEEK_V3_YARN)
    assert ds.cos_sin_factor == 1.0 and ds.softmax_scale_factor == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    v2 = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707)
    assert v2.cos_sin_factor == 1.0 and v2.softmax_scale_factor == pytest.approx((0.0707 * math.log(40) + 1) ** 2)
    plain = YarnScaling(factor=8.0, original_max_position_embeddings=16)
    assert plain.cos_sin_factor == pytest.approx(0.1 * math.log(8) + 1) and plain.softmax_scale_factor == 1.0
    mixed = YarnScaling(factor=4.0, original_max_position_embeddings=16, mscale=0.5, mscale_all_dim=2.0)
    assert mixed.cos_sin_factor == pytest.approx((0.05 * math.log(4) + 1) / (0.2 * math.log(4) + 1))
    assert YarnScaling(factor=4.0, original_max_position_embeddings=16, attention_factor=0.5).cos_sin_factor == 0.5
    assert yarn_get_mscale(1.0, 5.0) == 1.0 and yarn_get_mscale(0.5) == 1.0


@pytest.mark.parametrize("interleave", [True, False])
def test_yarn_rope_is_relative_and_scales_norms(interleave):
    """Still a rotation per pair (scores depend on m - n), times the cos/sin factor."""
    y = YarnScaling(factor=4.0, original_max_position_embeddings=16, mscale=0.5, mscale_all_dim=1.0)
    rope = RotaryEmbedding(16, interleave=interleave, scaling=y)
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16, dtype=torch.float64)

    def dot(m, n):
        return (rope(q, torch.tensor([[m]])) * rope(k, torch.tensor([[n]]))).sum()

    torch.testing.assert_close(dot(70, 3), dot(167, 100))
    torch.testing.assert_close(rope(q, torch.tensor([[50]])).norm(), q.norm() * y.cos_sin_factor)
    plain = RotaryEmbedding(16, interleave=interleave)
    assert not torch.allclose(rope(q, torch.tensor([[50]])) / y.cos_sin_factor, plain(q, torch.tensor([[50]])))


def test_mla_config_yarn_scale_and_dict_round_trip():
    cfg = MLAConfig(rope_scaling=DEEPSEEK_V3_YARN)
    assert isinstance(cfg.rope_scaling, YarnScaling) and cfg.rope_scaling.factor == 40
    assert cfg.scale == pytest.approx(24 ** -0.5 * (0.1 * math.log(40) + 1) ** 2)
    assert MLAConfig(rope_scaling=DEEPSEEK_V3_YARN, softmax_scale=0.5).scale == 0.5  # an explicit tau is used as is
    assert MLAConfig(**dataclasses.asdict(cfg)) == cfg  # a saved config (asdict) loads back
    assert MLAConfig(rope_scaling={"rope_type": "default"}).rope_scaling is None
    assert MLA(cfg).rotary.scaling == cfg.rope_scaling


YARN = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("bad,match", [
    ({"type": "linear", "factor": 2.0}, r"rope_scaling: rope_type 'linear' is not supported; "
                                        r"allowed: \('default', 'yarn'\)"),
    ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling: YaRN needs 'original_max_position_embeddings'"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 16}, "rope_scaling: YaRN needs 'factor'"),
    (dict(YARN, factor=0.5), "rope_scaling.factor: expected a finite number >= 1"),
    (dict(YARN, original_max_position_embeddings=0), "rope_scaling.original_max_position_embeddings"),
    (dict(YARN, beta_fast=0.5), "rope_scaling.beta_fast"),
    (dict(YARN, mscale=-1.0), "rope_scaling.mscale"),
    (dict(YARN, scale=1.0), "unknown YaRN keys"),
    (dict(YARN, partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("yarn", "rope_scaling: expected None, a YarnScaling or a dict"),
])
def test_mla_config_rejects_bad_rope_scaling(bad, match):
    with pytest.raises(ValueError, match=match):
        MLAConfig(rope_scaling=bad)


def test_frequencies_survive_dtype_changes():
    """.to(bfloat16) keeps the frequencies in float32 (not 3 digits), and .double() restores them exactly."""
    y = YarnScaling(factor=4.0, original_max_position_embeddings=16)
    rope = RotaryEmbedding(16, scaling=y)
    exact = y.inv_freq(16, 10000.0)
    assert rope.to(torch.bfloat16).inv_freq.dtype == torch.float32
    torch.testing.assert_close(rope.inv_freq, exact.float(), rtol=0, atol=0)
    assert torch.equal(rope.float().double().inv_freq, exact)
    x = torch.randn(1, 1, 1, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(rope(x, torch.tensor([[4000]])).float(),
                               RotaryEmbedding(16, scaling=y).double()(x.double(), torch.tensor([[4000]])).float(),
                               rtol=1e-2, atol=1e-2)  # bfloat16 output rounding only


@pytest.mark.parametrize("yarn", [False, True], ids=["plain", "yarn"])
@pytest.mark.parametrize("interleave", [True, False])
def test_shift_moves_rotated_keys_to_new_positions(interleave, yarn):
    """Keys rotated at positions p and shifted by o equal keys rotated at p + o directly:
    the shift is a pure rotation, since YaRN's cos/sin factor (here 0.87) was applied at p."""
    y = YarnScaling(factor=4.0, original_max_position_embeddings=16, mscale=0.5, mscale_all_dim=1.0) if yarn else None
    rope = RotaryEmbedding(16, interleave=interleave, scaling=y).double()
    assert (rope.attention_factor != 1.0) == yarn
    v = torch.randn(2, 5, 1, 16, dtype=torch.float64)
    p = torch.tensor([[0, 7, 9, 40, 41], [3, 4, 100, 101, 5000]])
    new = torch.tensor([[0, 1, 2, 3, 4], [0, 1, 2, 3, 6000]])
    torch.testing.assert_close(rope.shift(rope(v, p), new - p), rope(v, new), rtol=1e-12, atol=1e-12)
    assert torch.equal(rope.shift(rope(v, p), torch.zeros_like(p)), rope(v, p))
