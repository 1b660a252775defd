"""The "qkmla" record of a checkpoint's config.json: one QKNormConfig, written as one dict, read back
as it was written, and records written before QKNormConfig (flat fields) read as they always were."""

import types

import pytest

from qkmla import QKNormConfig
from qkmla.integrations.hub.record import RECORD, describe, record_norm, recorded_groups, recorded_norm

NORMS = [QKNormConfig(), QKNormConfig("lp", "unified", 3.0, 1e-5, learnable_logit_scale=True),
         QKNormConfig("rms", "content", scope="projection"), QKNormConfig(None, learnable_logit_scale=True)]


@pytest.mark.parametrize("norm", NORMS, ids=lambda n: describe(n))
def test_a_norm_is_recorded_as_one_dict_and_read_back(norm):
    config = types.SimpleNamespace(num_attention_heads=4)
    record_norm(config, norm)
    assert getattr(config, RECORD) == {"qk_norm": norm.record()}
    assert recorded_norm(config) == norm and recorded_norm({RECORD: getattr(config, RECORD)}) == norm
    record_norm(config, None)
    assert recorded_norm(config) is None


def test_a_record_written_before_qk_norm_config_reads_as_it_did():
    flat = {"qk_norm": "lp", "qk_norm_mode": "unified", "qk_norm_p": 3.0, "qk_norm_eps": 1e-5,
            "learnable_logit_scale": True}
    assert recorded_norm({RECORD: flat}) == NORMS[1]
    assert recorded_norm({RECORD: {"qk_norm": "rms", "qk_norm_scope": "projection", "qk_norm_mode": "content"}}) \
        == NORMS[2]
    assert recorded_norm({RECORD: {"qk_norm": None, "learnable_logit_scale": True}}) == NORMS[3]
    # a flat record without a norm kept the norm's other fields at whatever they were: no norm
    assert recorded_norm({RECORD: {"qk_norm": None, "qk_norm_mode": "unified", "qk_norm_p": 3.0}}) is None
    assert recorded_norm({RECORD: {"qk_norm_mode": "content", "learnable_logit_scale": True}}) == NORMS[3]
    assert recorded_norm({RECORD: {"num_kv_groups": 2}, "num_attention_heads": 4}) is None
    assert recorded_groups({RECORD: {"qk_norm": "rms", "num_kv_groups": 2}, "num_attention_heads": 4}) == 2


@pytest.mark.parametrize("record, match", [
    ({"qk_norm": "rms", "qk_norm_p": 0.5}, "config.json: its 'qkmla' entry is not valid: qk_norm_p: expected a finite"),
    ({"qk_norm": "rmsnorm"}, r"qk_norm: expected one of \(None, 'rms', 'l2', 'lp'\)"),
    ({"qk_norm": {"kind": "rms", "p": 0.5}}, "config.json: its 'qkmla' entry is not valid: qk_norm.p: expected"),
    ({"qk_norm": {"kind": "rms"}, "qk_norm_mode": "unified"}, r"must be a dict of 'qk_norm' .* got \['qk_norm_mode'\]"),
    ({"qk_norm": "rms", "gamma": 1}, r"got \['gamma'\]"),
])
def test_a_record_that_is_not_valid_is_refused_naming_its_key(record, match):
    with pytest.raises(ValueError, match=match):
        recorded_norm({RECORD: record}, where="config.json")
