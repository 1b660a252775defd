"""A QK norm on a whole transformers model: added by ``apply_latent_attention(qk_norm=...)``,
recorded in its config, saved with ``save_pretrained``, loaded with ``qkmla.integrations.transformers.from_pretrained``,
refused by transformers alone, and refused when the saved record and tensors disagree."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from qkmla import QKNormConfig  # noqa: E402
from qkmla.integrations.transformers import apply_latent_attention, from_pretrained  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402
from qkmla.integrations.hub.record import LOADER, RECORD, stock_model_type  # noqa: E402

from .test_model import CACHE, hf_model, max_rel, patched, prompts, stepwise_logits  # noqa: E402

NORMS = {  # name: apply_latent_attention's QK-norm arguments
    "rms": dict(qk_norm="rms"),
    "rms-unified": dict(qk_norm=QKNormConfig("rms", mode="unified")),
    "l2": dict(qk_norm="l2"),
    "lp3-learned-scale": dict(qk_norm=QKNormConfig("lp", p=3.0, learnable_logit_scale=True)),
}


def perturb_norms(model, seed: int = 0) -> None:
    """Norm weights (and learned logit scales) away from their initial values, as training leaves them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".q_norm." in name or ".k_norm." in name or name.endswith("logit_scale"):
                p.mul_(0.5 + torch.rand(p.shape, generator=g, dtype=p.dtype))


def norm_names(model) -> list[str]:
    return sorted(n for n, _ in model.named_parameters() if ".q_norm." in n or ".k_norm." in n or "logit_scale" in n)


@pytest.mark.parametrize("norm", list(NORMS))
def test_norm_weights_take_transformers_names_and_the_cache_matches_the_explicit_path(norm):
    """Every layer gains q_norm.* / k_norm.* under self_attn (one weight per block); the model's
    function changes; its prefill and every absorbed decode step match the uncached explicit
    forward in float64 (each layer's two paths agree to roundoff: the layer tests, and
    test_the_normalized_logits_are_computed_from_transformers_own_modules here)."""
    model = hf_model("v3")
    qk = patched(model, **NORMS[norm])
    perturb_norms(qk)
    want = [f"model.layers.{i}.self_attn.{side}.{block}.weight" for i in range(3) for side in ("k_norm", "q_norm")
            for block in ("content", "rope")]
    if QKNormConfig.of(NORMS[norm]["qk_norm"]).learnable_logit_scale:
        want += [f"model.layers.{i}.self_attn.logit_scale" for i in range(3)]
    assert norm_names(qk) == sorted(want)
    ids = torch.stack(prompts([12, 12]))
    with torch.no_grad():
        assert max_rel(qk(input_ids=ids).logits, model(input_ids=ids).logits) > 1e-3
    logits, fed = stepwise_logits(qk, ids, 6)
    with torch.no_grad():
        full = qk(input_ids=torch.cat([ids, fed], dim=1), use_cache=False).logits
    for i, step in enumerate(logits):  # attention agrees to 1e-15; transformers' MoE router rounds in
        # float32, differently for one token than for a sequence (measured up to 1e-7 after an MoE layer)
        assert max_rel(step, full[:, ids.shape[1] - 1 + i]) < 1e-6


def test_the_normalized_logits_are_computed_from_transformers_own_modules():
    """qk_norm="rms", unit weights: tau (RMSNorm(q^C) . RMSNorm(k^C) + RoPE(RMSNorm(q^R)) . RoPE(RMSNorm(k^R))),
    with q, k and RoPE taken from transformers' own modules."""
    v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    model = hf_model("v3")
    hf = model.model.layers[1].self_attn
    layer = latent_layers(patched(model, qk_norm="rms"))[1]
    T, x = 10, torch.randn(2, 10, 64, dtype=torch.float64)
    with torch.no_grad():
        q = hf.q_b_proj(hf.q_a_layernorm(hf.q_a_proj(x))).view(2, T, 4, 24).transpose(1, 2)
        q_c, q_r = q.split([16, 8], -1)
        c_kv, k_r = hf.kv_a_proj_with_mqa(x).split([32, 8], -1)
        k_c = hf.kv_b_proj(hf.kv_a_layernorm(c_kv)).view(2, T, 4, 32).transpose(1, 2)[..., :16]
        norm = lambda v: F.rms_norm(v, (v.shape[-1],), eps=1e-6)  # noqa: E731
        cos, sin = model.model.rotary_emb(x, torch.arange(T)[None])
        q_r, k_r = v3.apply_rotary_pos_emb_interleave(norm(q_r), norm(k_r.view(2, 1, T, 8)), cos, sin)
        want = hf.scaling * (norm(q_c) @ norm(k_c).transpose(-1, -2) + q_r @ k_r.transpose(-1, -2))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for path in ("explicit", "absorbed"):  # transformers' RoPE tables are float32
            torch.testing.assert_close(layer.logits(x, path)[..., causal], want[..., causal], rtol=1e-6, atol=1e-6)
        explicit, absorbed = layer.logits(x, "explicit")[..., causal], layer.logits(x, "absorbed")[..., causal]
        assert max_rel(absorbed, explicit) < 1e-14  # qkmla's two paths: roundoff (measured 5e-16)


@pytest.mark.parametrize("norm", list(NORMS))
def test_save_pretrained_and_from_pretrained_give_the_same_model(norm, tmp_path):
    model = patched(hf_model("v3", dtype=torch.float32), **NORMS[norm])
    perturb_norms(model)
    model.save_pretrained(tmp_path, max_shard_size="40KB")  # several shards, norm weights among them
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    saved = json.loads((tmp_path / "config.json").read_text())
    assert QKNormConfig.of(saved[RECORD]["qk_norm"]) == QKNormConfig.of(NORMS[norm]["qk_norm"])
    assert saved["attn_implementation"] == LOADER
    back = from_pretrained(tmp_path, kv_format="int8")
    assert not back.training and latent_layers(back)[0].settings.kv_format == "int8"
    params, loaded = dict(model.named_parameters()), dict(back.named_parameters())
    assert sorted(params) == sorted(loaded)
    assert all(torch.equal(params[n], loaded[n]) for n in params)
    buffers, loaded = dict(model.named_buffers()), dict(back.named_buffers())
    assert sorted(buffers) == sorted(loaded) and all(torch.equal(buffers[n], loaded[n]) for n in buffers)
    apply_latent_attention(back)  # dense again; qk_norm=None keeps the norm
    ids = torch.stack(prompts([9, 9]))
    with torch.no_grad():
        # The same weights and buffers, bit for bit (above); the outputs to float32 roundoff:
        # on one CI machine they differed in the last bits (a BLAS that rounds by memory
        # alignment would do that; the cause was not pinned down), on this one they are equal.
        torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-6, atol=1e-6)
    assert torch.equal(back.generate(ids, max_new_tokens=5, do_sample=False),
                       model.generate(ids, max_new_tokens=5, do_sample=False))
    assert type(back) is transformers.DeepseekV3ForCausalLM  # the loading class does not leak
    import pickle

    again = pickle.loads(pickle.dumps(back))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-6, atol=1e-6)


def test_a_checkpoint_transformers_wrote_loads_as_plain_latent_mla(tmp_path):
    model = hf_model("v2", dtype=torch.float32)
    model.save_pretrained(tmp_path)
    back = from_pretrained(tmp_path)
    assert norm_names(back) == [] and all(layer.q_norm is None for layer in latent_layers(back))
    ids = torch.stack(prompts([7, 7]))
    with torch.no_grad():
        assert max_rel(back(input_ids=ids).logits, model(input_ids=ids).logits) < 1e-5
    assert RECORD not in json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("load", ["auto", "class", "pipeline"])
def test_a_qk_normed_checkpoint_is_never_loaded_without_its_norm(load, tmp_path):
    """Loading it as a plain DeepSeek model would drop the norm weights ("can be ignored") and
    compute another function. transformers' DeepSeek class refuses the recorded attn_implementation,
    quoting it (it names the loader to call). The Auto classes and pipeline load qkmla's architecture
    with the norm (test_architecture.py), asked for another attention implementation too (before
    qkmla's model type, that loaded the plain model): qkmla's latent attention replaces transformers'.
    Without qkmla imported transformers refuses the model type: test_architecture.py, in a fresh
    process."""
    from qkmla.integrations.transformers import QKNormDeepseekV3ForCausalLM

    from .test_generate import byte_tokenizer

    model = patched(hf_model("v3", dtype=torch.float32), qk_norm="rms")
    perturb_norms(model)
    model.save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    loaders = {"auto": lambda p: transformers.AutoModelForCausalLM.from_pretrained(p, attn_implementation="sdpa"),
               "class": transformers.DeepseekV3ForCausalLM.from_pretrained,
               "pipeline": lambda p: transformers.pipeline("text-generation", model=p,
                                                           model_kwargs={"attn_implementation": "sdpa"}).model}
    if load == "class":
        with pytest.raises(ValueError, match=LOADER.replace(".", r"\.")):
            loaders[load](str(tmp_path))
        return
    loaded = loaders[load](str(tmp_path))
    assert type(loaded) is QKNormDeepseekV3ForCausalLM and loaded.config._attn_implementation == "qkmla_latent"
    params = dict(loaded.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in model.named_parameters())


def test_a_plain_patched_model_saves_a_checkpoint_transformers_reads(tmp_path):
    model = patched(hf_model("v3", dtype=torch.float32))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert RECORD not in saved and "attn_implementation" not in saved
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_norm_is_added_to_a_patched_model_and_then_fixed():
    model = patched(hf_model("v3"))
    projections = [layer.kv_b_proj for layer in latent_layers(model)]
    apply_latent_attention(model, qk_norm="rms", decode_backend="torch")
    layers = latent_layers(model)
    assert [layer.kv_b_proj for layer in layers] == projections  # the same modules, not copies
    assert all(layer.config.qk_norm.kind == "rms" and layer.config.decode_backend == "torch" for layer in layers)
    assert getattr(model.config, RECORD)["qk_norm"]["kind"] == "rms" and not layers[0].training
    apply_latent_attention(model, kv_format="int8")  # qk_norm=None keeps it
    assert latent_layers(model)[0].config.qk_norm.kind == "rms"
    apply_latent_attention(model, qk_norm="rms")  # the same norm again: nothing changes
    with pytest.raises(ValueError, match=r"qk_norm: this model already has the QK norm rms blockwise .* cannot "
                                         r"become l2 blockwise"):
        apply_latent_attention(model, qk_norm="l2")
    with pytest.raises(ValueError, match="cannot become rms unified"):
        apply_latent_attention(model, qk_norm=QKNormConfig("rms", mode="unified"))
    assert latent_layers(model)[0].config.qk_norm.mode == "blockwise"


@pytest.mark.parametrize("norm, match", [
    (lambda: "layer", r"qk_norm: expected one of \(None, 'rms', 'l2', 'lp'\)"),
    (lambda: QKNormConfig("rms", mode="joint"), r"mode: expected one of \('blockwise', 'unified', 'content'\)"),
    (lambda: QKNormConfig("lp", p=0.5), "p: expected a finite number >= 1"),
    (lambda: QKNormConfig("rms", learnable_logit_scale="yes"), "learnable_logit_scale: expected True or False"),
    (lambda: QKNormConfig(None, mode="unified"), "mode: only read with a norm; give kind too"),
    (lambda: {"kind": "rms", "modes": "unified"}, r"qk_norm: unknown fields \['modes'\]"),
])
def test_a_norm_that_does_not_exist_is_refused_before_any_change(norm, match):
    """A bad norm is refused by name, when it is made or when apply_latent_attention reads its
    shorthand, before the model changes."""
    model = hf_model("v3")
    with pytest.raises(ValueError, match=match):
        apply_latent_attention(model, qk_norm=norm())
    assert type(model.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"


def _rewrite(path, drop=(), add=None):
    tensors = load_file(path)
    tensors = {k: v for k, v in tensors.items() if not any(d in k for d in drop)} | (add or {})
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture
def qk_dir(tmp_path):
    patched(hf_model("v3", dtype=torch.float32), qk_norm="rms").save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("damage, match", [
    (lambda d: _rewrite(d / "model.safetensors", drop=["layers.2.self_attn.k_norm.rope"]),
     r"records the norm .* lacks \['model.layers.2.self_attn.k_norm.rope.weight'\]"),
    (lambda d: _edit_config(d, qkmla=None, attn_implementation=None, model_type="deepseek_v3"),
     r"holds QK-norm weights .* records no norm"),
    (lambda d: _edit_config(d, qkmla=None), r"config.json: model_type 'qkmla_deepseek_v3' is a QK-normed "
                                            r"checkpoint's, but its 'qkmla' entry records no QK norm"),
    (lambda d: _edit_config(d, qkmla={"qk_norm": "rms", "qk_norm_mode": "unified"}),
     r"k_norm._extra_state says its weights belong to a rms blockwise QK norm, but .* records rms unified"),
    (lambda d: _edit_config(d, qkmla={"qk_norm": "rms", "learnable_logit_scale": True}),
     r"lacks \['model.layers.0.self_attn.logit_scale'"),
    (lambda d: _edit_config(d, qkmla={"qk_norm": "rmsnorm"}), r"config.json: its 'qkmla' entry is not valid: qk_norm"),
    (lambda d: _edit_config(d, qkmla={"qk_norm": "rms", "eps": 1}), r"config.json: its 'qkmla' entry must be a dict"),
    (lambda d: _rewrite(d / "model.safetensors", add={"model.layers.0.self_attn.q_norm.rope.weight": torch.ones(3)}),
     r"q_norm.rope.weight has shape \(3,\); the config in .* needs \(8,\)"),
])
def test_a_checkpoint_whose_record_and_tensors_disagree_is_refused_before_loading(qk_dir, damage, match, monkeypatch):
    damage(qk_dir)
    monkeypatch.setattr(transformers.DeepseekV3ForCausalLM, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("weights were read before the check")))
    with pytest.raises(ValueError, match=match):
        from_pretrained(qk_dir)


def test_a_checkpoint_saved_before_the_layered_layout_loads_with_its_norm(tmp_path):
    """Saved before qkmla.integrations: the old loader's name and the norm's fields flat."""
    model = patched(hf_model("v3", dtype=torch.float32), qk_norm="rms")
    perturb_norms(model)
    model.save_pretrained(tmp_path / "old")
    _edit_config(tmp_path / "old", attn_implementation="qkmla.interop.from_pretrained",
                 qkmla={"qk_norm": "rms", "qk_norm_mode": "blockwise", "qk_norm_p": 2.0, "qk_norm_eps": 1e-6},
                 model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], auto_map=None)
    back = from_pretrained(tmp_path / "old")
    ids = torch.stack(prompts([9, 9]))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-6, atol=1e-6)
    back.save_pretrained(tmp_path / "new")
    saved = json.loads((tmp_path / "new" / "config.json").read_text())
    assert saved["attn_implementation"] == LOADER and saved[RECORD] == {"qk_norm": QKNormConfig().record()}
    assert saved["model_type"] == "qkmla_deepseek_v3"  # and its own model type now (test_architecture.py)


def test_from_pretrained_bad_arguments(qk_dir, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="attn_implementation: qkmla's latent attention replaces"):
        from_pretrained(qk_dir, attn_implementation="sdpa")
    with pytest.raises(ValueError, match=r"qk_norm: from_pretrained loads the QK norm the checkpoint records .* "
                                         r"apply_latent_attention\(model, qk_norm=...\)"):
        from_pretrained(qk_dir, qk_norm="rms")  # was transformers' TypeError from the model's constructor
    with pytest.raises(ValueError, match="hf_dir: .* is not a directory"):
        from_pretrained(tmp_path / "nowhere")
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    # (every supported MLA family of the installed transformers, then qkmla's QK-normed model types)
    with pytest.raises(ValueError, match=r"describes a 'llama' model; qkmla loads \('deepseek_v2', 'deepseek_v3', "
                                         r".*'qkmla_deepseek_v2', 'qkmla_deepseek_v3'.*\)"):
        from_pretrained(other)
    run = tmp_path / "a-qkmla-run"  # a qkmla training run's config.json names no model_type
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"attn": "mla-qknorm", "steps": 10}))
    with pytest.raises(ValueError, match=r"names no model_type, so it is not a transformers checkpoint \(a qkmla "
                                         r"training run loads with qkmla.train.load_model"):
        from_pretrained(run)
    monkeypatch.setattr(transformers.DeepseekV3ForCausalLM, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("weights were read before the check")))
    with pytest.raises(ValueError, match="kv_format: expected one of"):
        from_pretrained(qk_dir, kv_format="fp4")
    with pytest.raises(ValueError, match="decode_backend: expected one of"):
        from_pretrained(qk_dir, decode_backend="cuda")


def test_a_reused_cache_of_a_loaded_model_decodes_with_the_norm(qk_dir):
    """The latent cache rows carry the key scalars: a second call continuing the cache gives what
    one call over the whole sequence gives."""
    model = from_pretrained(qk_dir)
    perturb_norms(model)
    ids = torch.stack(prompts([8, 8]))
    with torch.no_grad():
        first = model(input_ids=ids[:, :5], use_cache=True)
        cache = getattr(first, CACHE, None) or first.past_key_values
        rest = model(input_ids=ids[:, 5:], use_cache=True, **{CACHE: cache}).logits
        whole = model(input_ids=ids, use_cache=False).logits
    assert max_rel(rest, whole[:, 5:]) < 1e-5


def _gqa_model():
    """hf_model("v3") as a GQA conversion saves it: 2 KV groups of 2 heads, each group's kv_b_proj
    rows repeated for its heads, the groups recorded (qkmla.convert.gqa)."""
    from qkmla.integrations.hub.record import record_groups

    model = hf_model("v3")
    with torch.no_grad():
        for layer in model.model.layers:
            rows = layer.self_attn.kv_b_proj.weight.view(2, 2, 32, -1)  # [G, heads per group, d_n + d_v, d_c]
            rows.copy_(rows[:, :1].expand_as(rows).clone())
    record_groups(model.config, 2)
    return model


LOADED = {  # name: (model, apply_latent_attention's QK-norm arguments)
    **{name: (hf_model, kwargs) for name, kwargs in NORMS.items()},
    "gqa-projection-scope": (_gqa_model, dict(qk_norm=QKNormConfig("rms", scope="projection"))),
}


@pytest.mark.parametrize("norm", list(LOADED))
def test_the_layer_loaders_build_the_recorded_norm_with_its_weights(norm, tmp_path):
    """Issue 52, point 2: a checkpoint qkmla saved, loaded layer by layer (mla_layers_from_hf_dir,
    mla_config_from_hf), has each layer's recorded QK norm (and KV groups) with its trained
    weights: every layer computes what the attention layer of the model from_pretrained loads
    computes."""
    from qkmla import MLA
    from qkmla.integrations.hub import mla_layers_from_hf_dir
    from qkmla.integrations.hub.config import load_hf_attention_weights, mla_config_from_hf

    make, kwargs = LOADED[norm]
    model = patched(make(), **kwargs)
    perturb_norms(model)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    back = from_pretrained(tmp_path, dtype=torch.float64)
    layers = mla_layers_from_hf_dir(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    state = back.state_dict()  # transformers' names and shapes (kv_b_proj repeated per head)
    x = torch.randn(2, 10, 64, dtype=torch.float64)
    with torch.no_grad():
        for i, attn in enumerate(latent_layers(back)):
            ref = attn(x)[0]
            copied = load_hf_attention_weights(MLA(mla_config_from_hf(saved)).double(), state,
                                               prefix=f"model.layers.{i}.self_attn.")
            for mla in (layers[i], copied):
                # the loaded model keeps transformers' latent RMSNorms, which compute in float32 (measured
                # 2e-8 to 1e-7 here, plain MLA too); without the norm the outputs differ by 0.03 to 0.5
                assert max_rel(mla.eval()(x), ref) < 1e-6
                assert mla.config == attn.config
    want = QKNormConfig.of(kwargs["qk_norm"])
    assert mla_config_from_hf(saved).qk_norm == want and mla_config_from_hf(back.config).qk_norm == want
    plain = {k: v for k, v in saved.items() if k != RECORD} | {"model_type": stock_model_type(saved["model_type"])}
    with pytest.raises(ValueError, match=r"state_dict: holds QK-norm weights \(model.layers.0.self_attn.k_norm"):
        load_hf_attention_weights(MLA(mla_config_from_hf(plain)).double(), state, prefix="model.layers.0.self_attn.")


def test_a_qk_normed_layer_without_its_norm_weights_is_refused_naming_the_record(qk_dir):
    """transformers alone, told to load a QK-normed checkpoint as plain DeepSeek (an explicit
    attn_implementation), drops the norm weights; its layers' config still records the norm, so
    qkmla refuses to build plain MLA from them instead of computing another function."""
    from qkmla.integrations.hub import mla_from_hf

    alone = transformers.DeepseekV3ForCausalLM.from_pretrained(qk_dir, attn_implementation="eager")
    with pytest.raises(ValueError, match=r"hf_attention: its config records the QK norm rms blockwise \(the 'qkmla' "
                                         r"entry\), but the layer has no norm weights"):
        mla_from_hf(alone.model.layers[0].self_attn)
    with pytest.raises(ValueError, match=r"qk_norm: .* records the QK norm rms blockwise in its 'qkmla' entry"):
        apply_latent_attention(alone)
    assert type(alone.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"


def test_a_gqa_conversion_without_a_norm_loads_layer_by_layer_with_its_groups(tmp_path):
    """No norm, so transformers alone loads it (each group's kv_b_proj rows repeated for its
    heads); mla_from_hf and mla_layers_from_hf_dir keep the recorded G = 2 groups, one copy of
    each group's rows, and compute transformers' function."""
    from qkmla.integrations.hub import mla_from_hf, mla_layers_from_hf_dir

    _gqa_model().save_pretrained(tmp_path)
    alone = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert RECORD in json.loads((tmp_path / "config.json").read_text())
    x = torch.randn(2, 10, 64, dtype=torch.float64)
    cos_sin = alone.model.rotary_emb(x, torch.arange(10)[None])
    layers = mla_layers_from_hf_dir(tmp_path)
    with torch.no_grad():
        for i, layer in enumerate(alone.model.layers):
            causal = torch.full((10, 10), -torch.inf, dtype=torch.float64).triu(1)[None, None]
            ref = layer.self_attn(x, position_embeddings=cos_sin, attention_mask=causal)[0]
            for mla in (mla_from_hf(layer.self_attn), layers[i]):
                assert mla.config.num_kv_groups == 2 and mla.kv_b_proj.weight.shape == (2 * 32, 32)
                assert max_rel(mla.eval()(x), ref) < 1e-5  # transformers' float32 RoPE tables
