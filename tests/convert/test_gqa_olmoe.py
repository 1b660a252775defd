"""``convert_gqa`` on OLMoE: a QK norm over the whole q and k projections (one statistic per token, a
weight per channel: qkmla's ``QKNormConfig(scope="projection")``) and MoE layers, converted to a
DeepSeek-V2-architecture model (V2's softmax router is OLMoE's) with one key scalar per token.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2  # noqa: E402
from transformers.models.olmoe import modeling_olmoe as olmoe  # noqa: E402

from qkmla.integrations.transformers import LatentAttentionCache, from_pretrained  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402
from qkmla.convert.gqa import convert_gqa  # noqa: E402

from .test_gqa import _rms_norm64, away_from_init, family_config, logits, prompt  # noqa: E402
from tests.integrations.transformers.test_model import CACHE, max_rel, stepwise_logits  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _rotary64(self, x, position_ids):
    """OlmoeRotaryEmbedding.forward with float64 frequencies and tables."""
    c = self.config
    D = c.hidden_size // c.num_attention_heads
    inv_freq = 1.0 / (c.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    emb = torch.cat((position_ids[..., None].double() * inv_freq,) * 2, dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _olmoe_router64(self, hidden_states):
    """OlmoeTopKRouter.forward with its softmax in the input's dtype (transformers' is float32)."""
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, index = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1)
    return logits, top, index


def _v2_router64(self, hidden_states):
    """DeepseekV2TopkRouter.forward (greedy) in the input's dtype (transformers' casts to float32)."""
    logits = torch.nn.functional.linear(hidden_states.view(-1, self.hidden_dim), self.weight.to(hidden_states.dtype))
    top, index = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1, sorted=False)
    return logits, top * self.routed_scaling_factor, index


def _v2_moe64(self, hidden_states):
    """DeepseekV2Moe.forward of transformers < 5.5 (its router inline, greedy) in the input's dtype."""
    flat = hidden_states.view(-1, hidden_states.shape[-1])
    logits = torch.nn.functional.linear(flat, self.gate.weight.to(flat.dtype))
    top, index = torch.topk(logits.softmax(dim=-1), self.top_k, dim=-1, sorted=False)
    routed = self.experts(flat, index, top * self.routed_scaling_factor).view(*hidden_states.shape)
    return routed + self.shared_experts(hidden_states)


@pytest.fixture
def exact_float64(monkeypatch):
    """Both models' float32 casts lifted (norms, RoPE tables, routers), as test_gqa's fixture does."""
    for norm in (olmoe.OlmoeRMSNorm, v2.DeepseekV2RMSNorm):
        monkeypatch.setattr(norm, "forward", _rms_norm64)
    monkeypatch.setattr(olmoe.OlmoeRotaryEmbedding, "forward", _rotary64)
    monkeypatch.setattr(olmoe.OlmoeTopKRouter, "forward", _olmoe_router64)
    if hasattr(v2, "DeepseekV2TopkRouter"):  # transformers >= 5.5 (a router module)
        monkeypatch.setattr(v2.DeepseekV2TopkRouter, "forward", _v2_router64)
    else:
        monkeypatch.setattr(v2.DeepseekV2Moe, "forward", _v2_moe64)


def olmoe_model(seed: int = 0, dtype=torch.float64, **shape):
    """A random OlmoeForCausalLM with its norm weights away from ones (a different one per channel)."""
    torch.manual_seed(seed)
    # eager experts: torch's grouped_mm takes no float64
    config = family_config("Olmoe", **{**SMALL, **shape}, attn_implementation="sdpa", experts_implementation="eager")
    return away_from_init(transformers.OlmoeForCausalLM(config).to(dtype).eval())


def test_one_kv_head_full_rank_is_the_source_to_roundoff_and_caches_one_scalar(exact_float64):
    """G = 1, full rank, every RoPE pair kept: the logits (attention, router and experts) are the
    source's to float64 roundoff plus the constant-channel bound, step by step through the latent
    cache too, and greedy generation gives the same tokens. The query statistic spans all heads."""
    src = olmoe_model(num_key_value_heads=1)
    dst, report = convert_gqa(src)
    assert isinstance(dst, transformers.DeepseekV2ForCausalLM) and report.scope == "projection"
    layer = latent_layers(dst)[0]
    assert layer.config.qk_norm.scope == "projection" and layer.config.num_key_scalars == 1
    assert layer.q_norm.content.weight.shape == (4, 16) and layer.k_norm.content.weight.shape == (1, 16)
    ids = prompt(src)
    err = max_rel(logits(dst, ids), logits(src, ids))
    print(f"OLMoE G=1: max |logit error| / max |logit| = {err:.3g}")
    assert err < 1e-11, err
    steps, fed = stepwise_logits(dst, ids, 6)
    full = logits(src, torch.cat((ids, fed), dim=1))
    for i, step in enumerate(steps):
        assert max_rel(step, full[:, ids.shape[1] - 1 + i]) < 1e-11
    # the source's greedy tokens by hand: transformers 5.4's generate() on OLMoE trips over its own
    # config validation (tie_word_embeddings declared an int)
    want = ids
    for _ in range(8):
        want = torch.cat((want, logits(src, want)[:, -1:].argmax(-1)), dim=1)
    with torch.no_grad():
        got = dst.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)  # (an explicit mask: OLMoE's pad id 1 is also a token of these prompts)
    assert report.cache_values_per_token() == (report.kv_lora_rank + 16, 1)


def test_one_kv_head_in_float32_with_the_default_expert_kernels_is_the_source_to_its_roundoff():
    """transformers' own arithmetic (float32 casts, its default grouped-GEMM experts) in both models."""
    torch.manual_seed(0)
    config = family_config("Olmoe", **SMALL, num_key_value_heads=1)
    src = away_from_init(transformers.OlmoeForCausalLM(config).eval(), attention_gain=1.0)
    dst, _ = convert_gqa(src)
    ids = prompt(src)
    got, want = logits(dst, ids).double(), logits(src, ids).double()
    print(f"OLMoE float32: max |logit error| / max |logit| = {max_rel(got, want):.3g}")
    assert max_rel(got, want) < 2e-6
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_per_head_statistic_would_be_another_function(exact_float64):
    """The control: the same converted layers with their statistic taken per head instead of over the
    projection (the same per-head weights) are not the source: the scope is what makes it exact."""
    src = olmoe_model(num_key_value_heads=1)
    dst, _ = convert_gqa(src)
    ids = prompt(src)
    for layer in latent_layers(dst):
        layer.q_norm._scope = layer.k_norm._scope = "head"
    assert max_rel(logits(dst, ids), logits(src, ids)) > 1e-3


def test_several_kv_heads_keep_both_statistics_and_round_trip_with_one_scalar_per_token(tmp_path):
    """G = 2 KV heads: the statistics are exact (the RoPE key shared by the groups is the named
    approximation, so the logits move); save_pretrained records the scope and the groups, the norm
    weights keep a row per head, from_pretrained gives the same logits, and the cache per token and
    layer is the latent + the RoPE key + one scalar."""
    src = olmoe_model(num_key_value_heads=2, dtype=torch.float32)
    dst, report = convert_gqa(src, rope_dim=8)
    assert any("the key statistic (one per token over every KV group" in e for e in report.exact)
    assert any("RoPE key is shared by the 2 KV groups" in a for a in report.approximate)
    dst.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["qkmla"]
    assert record["qk_norm"]["scope"] == "projection" and record["num_kv_groups"] == 2
    loaded = from_pretrained(tmp_path)
    layer = latent_layers(loaded)[0]
    assert layer.q_norm.rope.weight.shape == (4, 8) and layer.k_norm.content.weight.shape == (2, 16)
    ids = prompt(src)
    # to float32 roundoff: the loaded model runs transformers' default expert kernels, the converted one
    # the source's eager ones
    assert max_rel(logits(loaded, ids), logits(dst, ids)) < 1e-6
    cache = LatentAttentionCache(loaded)
    with torch.no_grad():
        loaded(input_ids=ids, use_cache=True, **{CACHE: cache})
    assert cache.bytes_per_token == 2 * (report.kv_lora_rank + 8 + 1) * 4


@pytest.mark.parametrize("change,match", [
    ({"norm_topk_prob": True}, "model: its router renormalizes the top-k probabilities"),
    ({"clip_qkv": 8.0}, r"model: it clips q, k and v to \+-8.0 \(clip_qkv\)"),
])
def test_what_deepseek_v2_cannot_express_is_refused_naming_model(change, match):
    with pytest.raises(ValueError, match=match):
        convert_gqa(olmoe_model(dtype=torch.float32, **change))


def test_cli_converts_an_olmoe_checkpoint_that_loads_and_generates(tmp_path, capsys):
    from qkmla.cli import main

    src = olmoe_model(num_key_value_heads=2, dtype=torch.float32, vocab_size=384)
    try:
        src.save_pretrained(tmp_path / "src")
    except Exception as e:  # huggingface_hub's StrictDataclassFieldValidationError
        if "tie_word_embeddings" not in str(e):
            raise
        pytest.skip(f"transformers {transformers.__version__} cannot save an OLMoE model: its OlmoeConfig declares "
                    f"tie_word_embeddings an int and rejects its own default False")
    transformers.ByT5Tokenizer().save_pretrained(tmp_path / "src")
    out = tmp_path / "dst"
    assert main(["convert-gqa", "--hf", str(tmp_path / "src"), "--out", str(out), "--rope-dim", "8"]) == 0
    printed = capsys.readouterr().out
    assert "+ 1 key scalars" in printed and f"wrote {out}" in printed
    want, _ = convert_gqa(src, rope_dim=8)
    ids = prompt(src)
    assert max_rel(logits(from_pretrained(out), ids), logits(want, ids)) < 1e-6
    assert main(["generate", "--hf", str(out), "--prompt", "To be", "--tokens", "4"]) == 0


def test_an_edited_expert_width_is_refused_naming_the_tensor(tmp_path, capsys):
    """Review 15b: OLMoE checkpoints store each expert's gate/up/down weights, which the model fuses, so the shape
    check (by name) missed them: a config.json edited to twice the intermediate size ended in transformers'
    mismatch report and an internal error. Refused in one line naming --hf and the tensor, before any load."""
    from qkmla.cli import main

    src = olmoe_model(num_key_value_heads=2, dtype=torch.float32, vocab_size=384)
    try:
        src.save_pretrained(tmp_path / "src")
    except Exception as e:  # as in the test above
        if "tie_word_embeddings" not in str(e):
            raise
        pytest.skip(f"transformers {transformers.__version__} cannot save an OLMoE model")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["intermediate_size"] *= 2
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["convert-gqa", "--hf", str(tmp_path / "src"), "--out", str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert "LOAD REPORT" not in err and "internal error" not in err, err
    assert re.search(r"^qkmla convert-gqa: --hf: .*model.safetensors: "
                     r"model\.layers\.0\.mlp\.experts\.0\.\w+_proj\.weight "
                     r"has shape \(\d+, \d+\); the config in .*config.json needs", err.strip().splitlines()[-1]), err
    assert not (tmp_path / "dst").exists()


def test_the_principal_rope_key_mixes_the_weighted_rows_and_holds_at_least_the_means_energy():
    """G = 2: the principal mix is fitted to the keys times the norm's weight per channel (what the
    RoPE key's rows carry), so it holds at least the mean's share of that energy."""
    src = olmoe_model(num_key_value_heads=2, dtype=torch.float32)
    calibration = prompt(src, B=4, T=16, seed=3)
    _, mean = convert_gqa(src, rope_dim=8, calibration=calibration)
    dst, principal = convert_gqa(src, rope_dim=8, rope_key="principal", calibration=calibration)
    assert all(p >= m - 1e-9 for p, m in zip(principal.rope_key_energy, mean.rope_key_energy))
    assert principal.rope_key_energy != mean.rope_key_energy
    assert torch.isfinite(logits(dst, prompt(src))).all()


def test_dropping_the_norm_drops_its_weights_from_the_rope_key_too(exact_float64):
    """keep_norm=False (what TransMLA and CARE do) is the source with q_norm and k_norm removed: the
    key norm's weight per channel must not stay in the RoPE key's rows."""
    import copy

    src = olmoe_model(num_key_value_heads=1)
    bare = copy.deepcopy(src)
    for layer in bare.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = torch.nn.Identity()
    dst, report = convert_gqa(src, keep_norm=False)
    ids = prompt(src)
    err = max_rel(logits(dst, ids), logits(bare, ids))
    print(f"OLMoE keep_norm=False against the source without its norm: {err:.3g}")
    assert err < 1e-10 and max_rel(logits(dst, ids), logits(src, ids)) > 1e-3


def test_the_principal_rope_key_is_exact_for_proportional_kv_heads_with_equal_norm_rows(exact_float64):
    """G = 2 whose second KV head's key rows are twice the first's and whose k_norm rows are equal:
    the groups' weighted keys are multiples of one vector, which the principal mix holds exactly and
    the mean does not."""
    src = olmoe_model(num_key_value_heads=2)
    with torch.no_grad():
        for layer in src.model.layers:
            a = layer.self_attn
            k = a.k_proj.weight.view(2, 16, -1)
            k[1].copy_(2.0 * k[0])
            gamma = a.k_norm.weight.view(2, 16)
            gamma[1].copy_(gamma[0])
    ids, calibration = prompt(src), prompt(src, B=4, T=16, seed=3)
    errors = {key: max_rel(logits(convert_gqa(src, rope_key=key, calibration=calibration)[0], ids), logits(src, ids))
              for key in ("mean", "principal")}
    print(f"OLMoE proportional KV heads: {errors}")
    assert errors["principal"] < 1e-10 < 1e-3 < errors["mean"]
