"""`qkmla verify`'s YaRN rows: both paths under DeepSeek's YaRN, and a path that drops a YaRN factor fails."""

from qkmla.cli import verify
from qkmla.attention.mla import MLA


def test_yarn_rows_pass_and_use_yarn():
    for name in ("rms-yarn", "none-yarn"):
        rows = verify.verify_variant(name, verify.VARIANTS[name])
        assert [r.dtype for r in rows] == ["float64", "float32", "bfloat16"] and all(r.ok for r in rows)
        cfg = verify.BASE.replace(**verify.VARIANTS[name])
        assert cfg.rope_scaling.original_max_position_embeddings < 33  # positions run past L0
        assert cfg.rope_scaling.cos_sin_factor != 1.0 and cfg.scale != cfg.qk_head_dim ** -0.5


def test_yarn_row_fails_when_the_absorbed_path_drops_the_cos_sin_factor(monkeypatch):
    original = MLA.absorbed_query

    def dropped(self, x, positions):
        q_lat, q_rope = original(self, x, positions)
        return q_lat, q_rope / self.rotary.attention_factor

    monkeypatch.setattr(MLA, "absorbed_query", dropped)
    rows = verify.verify_variant("rms-yarn", verify.VARIANTS["rms-yarn"])
    assert not rows[0].ok and rows[0].max_abs_logit_diff > 1e-3 * rows[0].max_abs_logit


def test_in_float64_the_two_paths_agree_to_roundoff():
    """The README's parity figure: in float64 every variant's explicit and absorbed logits differ
    by at most 1e-14 of the largest logit (a verify row fails only above 1e-10)."""
    rows = [r for r in verify.run(seed=0) if r.dtype == "float64"]
    assert len(rows) == len(verify.VARIANTS)
    assert all(r.max_abs_logit_diff <= 1e-14 * r.max_abs_logit for r in rows), [
        (r.variant, r.max_abs_logit_diff / r.max_abs_logit) for r in rows]
