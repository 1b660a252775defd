"""``convert_gqa``: a random-weight transformers Qwen3 model converted to a DeepSeek-V3-architecture
model with qkmla's content-mode QK norm (MATH.md, "Content variant"), checked against the source.

transformers computes RMSNorms and RoPE tables in float32 even in a float64 model; the float64
comparisons lift those casts (``exact_float64``) in both the source and the converted model, so
what remains is float64 roundoff plus the constant latent channel's bound (report.scale_bound,
<= 2^-41 = 4.5e-13 relative).
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3 as qwen3  # noqa: E402

from qkmla.cli import main  # noqa: E402
from qkmla.integrations.transformers import LatentAttentionCache, from_pretrained  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402
from qkmla.convert.gqa import convert_gqa  # noqa: E402

from tests.integrations.transformers.test_model import CACHE, max_rel, stepwise_logits  # noqa: E402

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


def away_from_init(model, attention_gain: float = 3.0):
    """``model`` with its norm weights moved away from ones (a random factor per channel) and its
    attention projections scaled by ``attention_gain`` (larger logits than at initialization)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(0.5 + torch.rand_like(p))
            elif "self_attn" in name:
                p.mul_(attention_gain)
    return model


def qwen3_model(seed: int = 0, dtype=torch.float64, **shape):
    """A random Qwen3ForCausalLM with its QK-norm and layer-norm weights away from ones."""
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(**{**SMALL, **shape}, attn_implementation="sdpa")
    return away_from_init(transformers.Qwen3ForCausalLM(config).to(dtype).eval())


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


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 5e-2)], ids=["float32", "bfloat16"])
def test_one_kv_head_in_float32_and_bfloat16_is_the_source_to_its_roundoff(dtype, tol):
    """transformers' own arithmetic (its float32 casts kept) in both models; the constant channel M
    (1.2e7 here) stays far inside float32's and bfloat16's range. Measured: 5.0e-7 (float32), 1.2e-2
    (bfloat16), the same greedy tokens."""
    src = qwen3_model(num_key_value_heads=1, dtype=dtype)
    dst, report = convert_gqa(src)
    ids = prompt(src)
    got, want = logits(dst, ids).double(), logits(src, ids).double()
    assert max_rel(got, want) < tol
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.fixture(scope="module")
def qwen3_06b():
    """A random float64 Qwen3 with Qwen3-0.6B's attention widths (two layers, 128 tokens)."""
    return qwen3_model(**QWEN3_06B)


def test_real_shape_several_kv_heads_keeps_every_statistic_and_reports_the_shared_rope_key(exact_float64, qwen3_06b):
    """Qwen3-0.6B widths (hidden 1024, 16 heads, 8 KV heads of 128): rank min(2 G D, hidden) = 1024 is
    exact; each group's normalized content key is Qwen3's k_norm(k_proj(x)) to roundoff (its statistic
    is exact); the RoPE key shared by 8 groups is not, and the report says so. The logit error is
    measured for the full RoPE width and for half the pairs (printed with -s)."""
    src = qwen3_06b
    ids = prompt(src, T=10)
    want = logits(src, ids)
    errors = {}
    for rope_dim, pairs in ((None, None), (64, "uniform"), (64, "high")):
        dst, report = convert_gqa(src, rope_dim=rope_dim, rope_pairs=pairs)
        assert (report.num_kv_groups, report.rank, report.max_rank, report.kv_lora_rank) == (8, 1024, 1024, 1025)
        assert "the latent (rank 1024 holds [W_K ; W_V])" in report.exact
        assert "every KV group's key statistic (content mode)" in report.exact
        assert any("shared by the 8 KV groups" in a for a in report.approximate)
        errors[(rope_dim, pairs)] = max_rel(logits(dst, ids), want)
    print("G=8 real shape, max |logit error| / max |logit|:", {k: f"{v:.3g}" for k, v in errors.items()})
    assert all(e > 1e-3 for e in errors.values())

    layer, src_layer = latent_layers(dst)[1], src.model.layers[1].self_attn
    assert layer.config.num_kv_groups == 8 and tuple(layer.kv_b_proj.weight.shape) == (8 * 256, 1025)
    x = torch.randn(2, 7, 1024, dtype=torch.float64)
    with torch.no_grad():
        _, k, _ = layer.explicit_qkv(x, torch.arange(7))
        source = src_layer.k_norm(src_layer.k_proj(x).view(2, 7, 8, 128))
    assert max_rel(k[..., :128], source) < 1e-11


def test_reduced_rank_and_rope_width_run_and_their_error_grows(exact_float64):
    """G = 2: smaller latents give larger logit errors, each reported as approximate."""
    src = qwen3_model(num_key_value_heads=2)
    ids = prompt(src)
    want = logits(src, ids)
    errors = []
    for rank in (64, 32, 16, 8):
        dst, report = convert_gqa(src, kv_lora_rank=rank, rope_dim=8, rope_pairs="high")
        assert report.rank == rank and report.kv_lora_rank == rank + 1 and report.max_rank == 64
        assert (report.latent_error[0] == 0.0 if rank == 64 else report.latent_error[0] > 0.05)
        assert any(f"rank {rank} of [W_K ; W_V]" in a for a in report.approximate) == (rank < 64)
        errors.append(max_rel(logits(dst, ids), want))
        steps, _ = stepwise_logits(dst, ids, 3)  # the latent cache decodes what the explicit path computes
        full = logits(dst, ids)
        assert max_rel(steps[0], full[:, -1]) < 1e-12
    print("G=2 rope_dim=8 high, rank 64/32/16/8: max |logit error| / max |logit| =", [f"{e:.3g}" for e in errors])
    assert errors == sorted(errors) and errors[-1] > errors[0]


def test_save_and_load_round_trip_and_the_cache_holds_latent_rope_key_and_group_scalars(tmp_path):
    """save_pretrained writes kv_b_proj in transformers' shape (rows repeated per head) and records
    num_kv_groups beside the norm; from_pretrained gives the same logits; the cache per token and layer
    is the latent (r + 1) + the RoPE key (d_r) + G scalars."""
    src = qwen3_model(num_key_value_heads=2, dtype=torch.float32)
    dst, report = convert_gqa(src, kv_lora_rank=20, rope_dim=8)
    dst.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["qkmla"] == {"qk_norm": {"kind": "rms", "mode": "content", "p": 2.0, "eps": 1e-6, "scope": "head",
                                           "learnable_logit_scale": False}, "num_kv_groups": 2}
    assert config["kv_lora_rank"] == 21 and config["qk_rope_head_dim"] == 8
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("model.layers.0.self_attn.kv_b_proj.weight").get_shape()) == (4 * 32, 21)
    loaded = from_pretrained(tmp_path)
    assert [layer.config.num_kv_groups for layer in latent_layers(loaded)] == [2, 2]
    ids = prompt(src)
    assert torch.equal(logits(loaded, ids), logits(dst, ids))
    cache = LatentAttentionCache(loaded)
    with torch.no_grad():
        loaded(input_ids=ids, use_cache=True, **{CACHE: cache})
    assert report.cache_values_per_token() == (21 + 8, 2)
    assert cache.bytes_per_token == 2 * (21 + 8 + 2) * 4

    sd = loaded.state_dict()  # a state dict that does not repeat the group rows is refused on load
    sd["model.layers.0.self_attn.kv_b_proj.weight"][0, 0] += 1.0
    with pytest.raises(ValueError, match="rows of the heads of a group are not equal"):
        loaded.load_state_dict(sd)


@pytest.mark.parametrize("kwargs,match", [
    ({"kv_lora_rank": 65}, r"kv_lora_rank: expected an int from 1 to .* = 64"),
    ({"kv_lora_rank": 0}, "kv_lora_rank: expected an int from 1"),
    ({"rope_dim": 7}, "rope_dim: expected an even int from 2 to head_dim=16"),
    ({"rope_dim": 18}, "rope_dim: expected an even int from 2 to head_dim=16"),
    ({"rope_dim": 6}, r"rope_dim: 'uniform' pairs .* \(allowed: \[2, 4, 8, 16\]\)"),
    ({"rope_pairs": "low", "rope_dim": 8}, "rope_pairs: expected one of"),
    ({"rope_pairs": "high"}, r"rope_pairs: only read with rope_dim"),  # every pair kept: the choice was dropped
], ids=["rank-too-large", "rank-zero", "rope-odd", "rope-wider-than-head", "rope-not-uniform", "rope-pairs",
        "rope-pairs-without-rope-dim"])
def test_bad_arguments_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        convert_gqa(qwen3_model(num_key_value_heads=2, dtype=torch.float32), **kwargs)


def test_rope_dim_not_a_divisor_is_taken_with_high_pairs():
    _, report = convert_gqa(qwen3_model(num_key_value_heads=2, dtype=torch.float32), rope_dim=6, rope_pairs="high")
    assert report.kept_pairs == [0, 1, 2] and report.rope_theta == pytest.approx(1000.0 ** (6 / 16))


def family_config(family: str, tie_word_embeddings: bool = False, **kwargs):
    """transformers' ``{family}Config(**kwargs)``. transformers 5.4 declares OLMo 2's and OLMoE's
    tie_word_embeddings an int yet defaults it to False, which its own strict validation rejects:
    the field gets the type its class declares."""
    config_class = getattr(transformers, f"{family}Config")
    declared = next((c.__annotations__["tie_word_embeddings"] for c in config_class.__mro__
                     if "tie_word_embeddings" in getattr(c, "__annotations__", {})), bool)
    tie = declared(tie_word_embeddings) if declared in (int, bool) else tie_word_embeddings
    return config_class(tie_word_embeddings=tie, **kwargs)


@pytest.mark.parametrize("family,match", [
    ("Olmo2", "OLMo 2 normalizes each sublayer's output"),
    ("Qwen3Moe", "norm_topk_prob=False"),
])
def test_other_qk_normed_families_are_refused_saying_why(family, match):
    config = family_config(family, vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2)
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    with pytest.raises(ValueError, match=f"model: expected one of .* got {family}ForCausalLM: .*{match}"):
        convert_gqa(model)


@pytest.mark.parametrize("change,match", [
    ("deepseek", "model: expected one of"),
    ("bias", "model: its attention projections have biases"),
    ("yarn", "model: its RoPE is 'yarn'"),
    ("sliding", "model: it has sliding-window layers"),
])
def test_sources_it_cannot_convert_are_refused_naming_model(change, match):
    if change == "deepseek":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8))
    else:
        extra = {"bias": {"attention_bias": True},
                 "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1000.0,
                                              "original_max_position_embeddings": 64}},
                 "sliding": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}}[change]
        model = qwen3_model(num_key_value_heads=2, dtype=torch.float32, **extra)
    with pytest.raises(ValueError, match=match):
        convert_gqa(model)


@pytest.mark.parametrize("argv, match", [
    (["--kv-lora-rank", "0"], r"--kv-lora-rank: expected an int from 1 to .* = 64"),
    (["--kv-lora-rank", "65"], r"--kv-lora-rank: expected an int from 1 to .* = 64"),
    (["--rope-dim", "3"], r"--rope-dim: expected an even int from 2 to head_dim=16"),
    (["--rope-dim", "6", "--rope-pairs", "uniform"], r"--rope-dim: 'uniform' pairs keep every"),
])
def test_the_rank_and_rope_width_are_refused_before_the_weights_load(tmp_path, monkeypatch, refused, argv, match):
    """They are checked against the source's shape, which its config.json gives: the refusal came
    after loading the whole checkpoint."""
    qwen3_model(num_key_value_heads=2, dtype=torch.float32).save_pretrained(tmp_path / "src")

    def loading(*args, **kwargs):
        raise AssertionError("the weights were loaded before the arguments were checked")

    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "from_pretrained", loading)
    refused(["convert-gqa", "--hf", str(tmp_path / "src"), "--out", str(tmp_path / "dst"), *argv], match)
    assert not (tmp_path / "dst").exists()


def test_a_float16_checkpoint_is_refused_before_its_weights_load_and_converts_with_dtype(tmp_path, monkeypatch,
                                                                                          refused, capsys):
    qwen3_model(num_key_value_heads=2, dtype=torch.float16).save_pretrained(tmp_path / "src")
    load = transformers.Qwen3ForCausalLM.from_pretrained

    def loading(*args, **kwargs):
        raise AssertionError("the weights were loaded before the arguments were checked")

    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "from_pretrained", loading)
    refused(["convert-gqa", "--hf", str(tmp_path / "src"), "--out", str(tmp_path / "dst")],
            r"--hf: .*src stores float16 weights, and float16 cannot hold the constant latent channel .*--dtype")
    monkeypatch.setattr(transformers.Qwen3ForCausalLM, "from_pretrained", load)
    assert main(["convert-gqa", "--hf", str(tmp_path / "src"), "--out", str(tmp_path / "dst"), "--dtype",
                 "float32"]) == 0
    capsys.readouterr()


def test_without_the_norm_the_model_changes_and_nothing_caches_a_scalar():
    src = qwen3_model(num_key_value_heads=1, dtype=torch.float32)
    dst, report = convert_gqa(src, keep_norm=False)
    assert all(layer.q_norm is None for layer in latent_layers(dst))
    assert report.cache_values_per_token() == (33 + 16, 0)
    assert any("QK norm is dropped" in a for a in report.approximate)
    ids = prompt(src)
    assert max_rel(logits(dst, ids), logits(src, ids)) > 1e-2


def test_cli_converts_a_checkpoint_directory_that_loads_and_generates(tmp_path, capsys):
    src = qwen3_model(num_key_value_heads=2, dtype=torch.float32, vocab_size=384)
    src.save_pretrained(tmp_path / "src")
    transformers.ByT5Tokenizer().save_pretrained(tmp_path / "src")
    out = tmp_path / "dst"
    argv = ["convert-gqa", "--hf", str(tmp_path / "src"), "--out", str(out), "--kv-lora-rank", "24",
            "--rope-dim", "8", "--rope-pairs", "high"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "latent rank 24 of at most 64 (kv_lora_rank 25" in printed and f"wrote {out}" in printed
    want, _ = convert_gqa(src, kv_lora_rank=24, rope_dim=8, rope_pairs="high")
    ids = prompt(src)
    assert torch.equal(logits(from_pretrained(out), ids), logits(want, ids))
    assert main(["generate", "--hf", str(out), "--prompt", "To be", "--tokens", "4"]) == 0
    capsys.readouterr()

    assert main(argv) == 2  # an existing DST is replaced only with --overwrite
    assert "--out: " in capsys.readouterr().err
    assert main(argv + ["--overwrite", "--rope-dim", "6", "--rope-pairs", "uniform"]) == 2
    assert "qkmla convert-gqa: --rope-dim: 'uniform' pairs" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["convert-gqa", "--hf", str(tmp_path / "other"), "--out", str(tmp_path / "x")]) == 2
    assert "--hf: " in capsys.readouterr().err


def test_a_converted_model_with_fewer_kv_groups_fine_tunes_with_lora_and_its_adapter_reloads(tmp_path):
    """G = 2 < h = 4: PEFT LoRA on q_proj, kv_b_proj (G groups inside, repeated rows on disk) and o_proj
    with the norm weights trained; the adapter saved and loaded onto the checkpoint read back by
    from_pretrained scores what the trained model scores; merged, it decodes through the latent cache."""
    peft = pytest.importorskip("peft")
    from qkmla.integrations.transformers import attention_lora_config, merge_lora

    src = qwen3_model(num_key_value_heads=2, dtype=torch.float32)
    dst, _ = convert_gqa(src, kv_lora_rank=20, rope_dim=8)
    dst.save_pretrained(tmp_path / "base")
    tuned = peft.get_peft_model(dst, attention_lora_config(dst, targets=("q_proj", "kv_b_proj", "o_proj"), r=4,
                                                           train_qk_norm=True))
    optimizer = torch.optim.AdamW([p for p in tuned.parameters() if p.requires_grad], lr=1e-2)
    ids = prompt(src)
    tuned.train()
    losses = []
    for _ in range(4):
        loss = tuned(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    tuned.eval()
    want = logits(tuned, ids)
    tuned.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    assert max_rel(logits(reloaded, ids), want) < 1e-6
    merged = merge_lora(tuned).eval()
    assert max_rel(logits(merged, ids), want) < 1e-5
    steps, fed = stepwise_logits(merged, ids, 4)
    full = logits(merged, torch.cat((ids, fed), dim=1))
    for i, step in enumerate(steps):
        assert max_rel(step, full[:, ids.shape[1] - 1 + i]) < 1e-4


def proportional_kv_heads(**shape):
    """A Qwen3 whose second KV head's key rows are twice the first's (values independent): at every
    frequency the two groups' keys are multiples of one vector, the case one shared RoPE key can hold."""
    src = qwen3_model(num_key_value_heads=2, **shape)
    with torch.no_grad():
        for layer in src.model.layers:
            k = layer.self_attn.k_proj.weight.view(2, -1, layer.self_attn.k_proj.weight.shape[-1])
            k[1].copy_(2.0 * k[0])
    return src


def test_the_principal_rope_key_holds_groups_whose_keys_are_proportional_where_the_mean_does_not(exact_float64):
    """G = 2, full rank, every pair kept. The mean of the groups' RoPE rows gives group 0 1.5x its key and
    group 1 0.75x; the principal mix u = (1, 2)/sqrt(5) per pair gives each its own: the logits are the
    source's to roundoff, and the report says the mix holds all of the key energy."""
    src = proportional_kv_heads()
    ids = prompt(src)
    calibration = prompt(src, B=4, T=16, seed=3)
    mean, mean_report = convert_gqa(src, calibration=calibration)
    principal, report = convert_gqa(src, rope_key="principal", calibration=calibration)
    err_mean, err_principal = max_rel(logits(mean, ids), logits(src, ids)), max_rel(logits(principal, ids),
                                                                                  logits(src, ids))
    print(f"proportional keys: mean {err_mean:.3g}, principal {err_principal:.3g}; energy "
          f"{mean_report.rope_key_energy} / {report.rope_key_energy}")
    assert err_principal < 1e-10 < 1e-2 < err_mean
    assert all(e == pytest.approx(1.0, abs=1e-12) for e in report.rope_key_energy)
    assert all(e < 0.95 for e in mean_report.rope_key_energy)
    assert any("principal mix" in a and "of the kept pairs' key energy" in a for a in report.approximate)


def test_on_unrelated_kv_heads_the_principal_mix_holds_at_least_the_means_energy(qwen3_06b):
    """Random weights at Qwen3-0.6B's widths (G = 8): the principal mix is the best single key per pair,
    so it holds at least the mean's share of the key energy on the same calibration tokens."""
    calibration = prompt(qwen3_06b, B=2, T=16, seed=3)
    _, mean = convert_gqa(qwen3_06b, kv_lora_rank=64, rope_dim=16, calibration=calibration)
    _, principal = convert_gqa(qwen3_06b, kv_lora_rank=64, rope_dim=16, rope_key="principal", calibration=calibration)
    print(f"Qwen3-0.6B widths, random: mean {mean.rope_key_energy}, principal {principal.rope_key_energy}")
    assert all(p >= m - 1e-12 for p, m in zip(principal.rope_key_energy, mean.rope_key_energy))
    assert len(principal.rope_key_energy) == 2


@pytest.mark.parametrize("kwargs,match", [
    ({"rope_key": "principal"}, "calibration: rope_key='principal' takes its mix"),
    ({"rope_key": "pca"}, "rope_key: expected one of"),
    ({"calibration": torch.zeros(4)}, r"calibration: expected a \[B, T\] int64 tensor"),
    ({"calibration": torch.full((1, 4), 97)}, r"calibration: token ids must lie in \[0, vocab_size=97\)"),
])
def test_bad_rope_key_settings_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        convert_gqa(qwen3_model(num_key_value_heads=2, dtype=torch.float32), **kwargs)


def test_cli_fits_the_principal_rope_key_to_calibration_text(tmp_path, capsys):
    src = proportional_kv_heads(dtype=torch.float32, vocab_size=384)
    src.save_pretrained(tmp_path / "src")
    transformers.ByT5Tokenizer().save_pretrained(tmp_path / "src")
    text = tmp_path / "calibration.txt"
    text.write_text("To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n" * 8)
    argv = ["convert-gqa", "--hf", str(tmp_path / "src"), "--out", str(tmp_path / "dst"), "--rope-key", "principal"]
    assert main(argv) == 2
    assert "--calibration-text: rope_key 'principal' fits its mix" in capsys.readouterr().err
    assert main(argv + ["--calibration-text", str(tmp_path / "missing.txt")]) == 2
    assert "--calibration-text: " in capsys.readouterr().err and not (tmp_path / "dst").exists()
    assert main(argv[:-2] + ["--latent", "activations"]) == 2
    assert "--calibration-text: latent 'activations' weights the factorization" in capsys.readouterr().err
    assert main(argv + ["--calibration-text", str(text), "--calibration-tokens", "512"]) == 0
    printed = capsys.readouterr().out
    assert "principal mix of their rows; it holds 1, 1 of the kept pairs' key energy" in printed
    ids = prompt(src)
    assert max_rel(logits(from_pretrained(tmp_path / "dst"), ids), logits(src, ids)) < 1e-4


def test_the_activation_weighted_latent_is_exact_at_full_rank_and_closer_on_its_inputs_when_truncated(exact_float64):
    """latent='activations' factors [W_K ; W_V] Sigma^(1/2) (Sigma: the calibration tokens' attention
    inputs): at full rank it is the source to roundoff as the weights' SVD is; truncated to rank 12 of
    32, its logits on other tokens are closer to the source's (measured: 0.819 of the largest logit
    against the weights' SVD's 1.16; random weights, so this is one draw, not a bound)."""
    src = qwen3_model(num_key_value_heads=1)
    calibration = prompt(src, B=8, T=32, seed=3)
    ids = prompt(src)
    full, report = convert_gqa(src, latent="activations", calibration=calibration)
    assert report.latent == "activations" and max_rel(logits(full, ids), logits(src, ids)) < 1e-10
    errors = {}
    for latent in ("weights", "activations"):
        model, report = convert_gqa(src, kv_lora_rank=12, latent=latent, calibration=calibration)
        errors[latent] = max_rel(logits(model, ids), logits(src, ids))
        assert any("rank 12 of [W_K ; W_V] (relative error per layer" in a for a in report.approximate)
    print(f"rank 12 of 32: logit error weights {errors['weights']:.3g}, activations {errors['activations']:.3g}")
    assert errors["activations"] < errors["weights"]
    with pytest.raises(ValueError, match="calibration: latent='activations' weights the factorization"):
        convert_gqa(src, latent="activations")
    with pytest.raises(ValueError, match="latent: expected one of"):
        convert_gqa(src, latent="data", calibration=calibration)
