"""Every MLA family of transformers through ``apply_latent_attention`` (``families.FAMILIES``).

Each supported family's model is built in memory from its own config class (no download): tiny
widths, a dense first layer and MoE after it where the family has MoE, a hybrid's linear-attention
layer beside its MLA layer, LongCat-Flash's two attention modules per layer. Families absent from
the installed transformers (the oldest tested, 5.4.0, has seven of them) are skipped, saying so.

Bounds as in ``test_model.py``: transformers computes its RoPE tables in float32 even in float64,
which bounds the logits' difference (1e-5 of the largest logit in float64, 1e-4 in float32);
Kimi-Linear's MLA layers have no RoPE, and agree far closer.
"""

from __future__ import annotations

import copy
import re
import types
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.integrations.transformers import apply_latent_attention  # noqa: E402
from qkmla.integrations.transformers.families import FAMILIES, family_named, markdown_table  # noqa: E402
from qkmla.integrations.transformers.patched import latent_layers  # noqa: E402
from qkmla.rope import RotaryEmbedding  # noqa: E402

from .helpers import CACHE, away_from_ones, max_rel, stepwise_logits  # noqa: E402

VOCAB = 61
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
             qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
             n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64, pad_token_id=0,
             bos_token_id=None, eos_token_id=None, experts_implementation="eager")
HYBRID = dict(layer_types=["linear_attention", "full_attention"], num_local_experts=4)
# Sparse attention: a top-k of 3 against prompts of 6 tokens and more, so the selection is real
# (test_the_sparse_selection_is_real); GLM-5's second layer reuses the first's top-k. Indexer widths
# of 4 heads of 16: with 2 heads of 8, ReLU zeroes every head's score for some keys, and the exact
# ties among them break differently in a step's [B, 1, C] top-k and a whole sequence's [B, T, T]
# (transformers' indexer alone shows it), which the QK-normed cached-vs-explicit test would read.
TOPK = 3
SPARSE_SHAPE = dict(index_topk=TOPK, index_head_dim=16, index_n_heads=4)
EXTRA = {  # what a family's config needs beyond SHAPE to be tiny, and to exercise its conventions
    "deepseek_v2": dict(q_lora_rank=None),
    "minicpm3": dict(scale_emb=2.0, scale_depth=1.4),
    # the llama-4 query scale starts at position 4 (transformers: original_max_position_embeddings)
    "mistral4": dict(rope_parameters=dict(rope_type="yarn", rope_theta=100.0, factor=4.0,
                                          original_max_position_embeddings=4, beta_fast=32.0, beta_slow=1.0,
                                          mscale_all_dim=1.0, mscale=1.0, llama_4_scaling_beta=0.5,
                                          partial_rotary_factor=1 / 3)),
    "longcat_flash": dict(num_layers=1, head_dim=4, ffn_hidden_size=48, expert_ffn_hidden_size=16, moe_topk=2,
                          zero_expert_num=2, hidden_size=48),
    "kimi_linear": dict(HYBRID, linear_head_dim=8, linear_num_heads=4, q_lora_rank=None),
    "bailing_hybrid": dict(HYBRID, head_dim=8, num_mtp_layers=0, q_lora_rank=None, num_experts=4),
    "deepseek_v32": SPARSE_SHAPE,
    "glm_moe_dsa": dict(SPARSE_SHAPE, indexer_types=["full", "shared"]),
    "hy_v4": dict(SPARSE_SHAPE, indexer_types=["full", "shared"], hc_mult=2),
    "axk2": dict(SPARSE_SHAPE, gated_norm_rank=4),
}
SUPPORTED = [f for f in FAMILIES if f.status == "supported"]
SPARSE_SUPPORTED = [f for f in SUPPORTED if f.build == "sparse"]
VERSION = tuple(int(v) for v in transformers.__version__.split(".")[:2])


CONFIGS = {"sarvam_mla": "SarvamMLAConfig"}  # a family built with another family's model classes


def model_class(family, taken: bool = True):
    """The family's causal LM class; the test skips, saying why, where this transformers does not ship
    it or (``taken``) ships an older form that qkmla refuses (GLM-5's DSA before 5.19)."""
    cls = getattr(transformers, family.causal_lm, None)
    if cls is None or not hasattr(transformers, CONFIGS.get(family.model_type, "PreTrainedConfig")):
        pytest.skip(f"transformers {transformers.__version__} does not ship {family.model_type} "
                    f"({family.causal_lm}; from {family.since})")
    if taken and family.taken_since and VERSION < tuple(int(v) for v in family.taken_since.split(".")[:2]):
        pytest.skip(f"transformers {transformers.__version__}'s {family.model_type} is refused: qkmla takes it "
                    f"from {family.taken_since} (families.FAMILIES)")
    return cls


def hf_model(family, dtype=torch.float64, seed: int = 0, taken: bool = True):
    """A random model of ``family`` (eval mode), norms and attention weights away from their init
    (``taken``: as ``model_class``)."""
    cls = model_class(family, taken)
    fields = dict(SHAPE, **EXTRA.get(family.model_type, {}))
    config = getattr(transformers, CONFIGS[family.model_type])(**fields) if family.model_type in CONFIGS \
        else cls.config_class(**fields)
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
            elif "self_attn" in name and p.dim() == 2:
                p.mul_(3.0)  # logits of a few units, so attention is not flat
            elif name.endswith("self_attn.sinks"):  # HY-V4's: sinks of a few units, each its own
                p.add_(1.0 + torch.randn_like(p))
    return model


def ids(batch: int = 2, length: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


BOUNDS = {torch.float64: 1e-5, torch.float32: 1e-4}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("family", SUPPORTED, ids=[f.model_type for f in SUPPORTED])
def test_prefill_and_every_decode_step_match_transformers(family, dtype):
    ref = hf_model(family, dtype)
    model = apply_latent_attention(copy.deepcopy(ref))
    prompt = ids()
    want, want_tokens = stepwise_logits(ref, prompt, 5)
    got, got_tokens = stepwise_logits(model, prompt, 5)
    assert torch.equal(got_tokens, want_tokens)
    for step, (a, b) in enumerate(zip(got, want)):
        assert max_rel(a, b) < BOUNDS[dtype], (family.model_type, step)
    layers = latent_layers(model)
    per_layer = 2 if family.model_type == "longcat_flash" else 1  # its two attention modules
    assert len(layers) == sum(family.mla_layers(model.config)) * per_layer
    assert all(layer.host == family.host(model.config) for layer in layers)


@pytest.mark.parametrize("family", SUPPORTED, ids=[f.model_type for f in SUPPORTED])
def test_qk_normed_absorbed_decode_equals_its_explicit_path(family):
    """With the QK norm the function is no longer transformers': the patched model's absorbed decode
    over its latent cache equals its own explicit path (no cache) over the whole sequence."""
    ref = hf_model(family)
    model = apply_latent_attention(copy.deepcopy(ref), qk_norm="rms")
    away_from_ones(latent_layers(model), 0.2)  # so they are read
    prompt = ids()
    cached, tokens = stepwise_logits(model, prompt, 4)
    sequence = torch.cat((prompt, tokens), dim=1)
    with torch.no_grad():
        explicit = model(input_ids=sequence, use_cache=False).logits
    # A hybrid's linear-attention layers are transformers' own: its recurrent decode and its chunked
    # prefill differ by their own roundoff, measured on the unpatched model, which bounds ours too.
    bound = 1e-9
    if family.host(ref.config).attention_sinks:
        # the sinks' share of each output reads the decode op's log-sum-exp, float32 by its contract (FlashMLA's)
        bound = 1e-6
    if any(name.endswith(".experts") for name, _ in ref.named_modules()):
        # transformers' MoE routers compute in float32 whatever the model's dtype, and a step's [B, 1] product
        # and a sequence's [B, T] one round differently there: the same router input gave expert weights one
        # float32 ulp apart (GLM-5 at transformers 5.24 on AVX-512: the MoE layer's output 2.4e-10 apart from
        # an equal input, the logits 7.4e-8), which no attention path can do better than
        bound = 1e-6
    if family.mla_layers is not None and not all(family.mla_layers(ref.config)):
        host_cached, host_tokens = stepwise_logits(ref, prompt, 4)
        with torch.no_grad():
            host = ref(input_ids=torch.cat((prompt, host_tokens), dim=1), use_cache=False).logits
        gap = max(max_rel(a, host[:, prompt.shape[1] - 1 + i]) for i, a in enumerate(host_cached))
        bound = max(bound, 10 * gap)
    for step, a in enumerate(cached):
        b = explicit[:, prompt.shape[1] - 1 + step]
        assert max_rel(a, b) < bound, (family.model_type, step)


@pytest.mark.parametrize("name, knock", [
    ("mistral4", dict(position_temperature=None)),
    ("longcat_flash", dict(latent_scale=1.0)),
    ("longcat_flash", dict(query_scale=1.0)),
    ("minicpm3", dict(rope="interleaved")),
    ("bailing_hybrid", dict(output_gate=None)),
    ("hy_v4", dict(output_gate=None)),
    ("hy_v4", dict(attention_sinks=False)),
    ("hy_v4", dict(rope="interleaved")),
    ("axk2", dict(output_gate=None)),
], ids=["mistral4-temperature", "longcat-latent-scale", "longcat-query-scale", "minicpm3-halves", "ling-gate",
        "hy-v4-gate", "hy-v4-sinks", "hy-v4-halves", "axk2-gate"])
def test_the_family_differences_are_applied(name, knock):
    """Each convention the table reads changes the function: switched off, the model differs."""
    family = family_named(name)
    ref = hf_model(family)
    model = apply_latent_attention(copy.deepcopy(ref))
    for layer in latent_layers(model):
        layer.host = type(layer.host)(**{**layer.host.__dict__, **knock})
        if "rope" in knock:  # a RotaryEmbedding's settings are fixed once made: a new one, rotating pairs
            r = layer.rotary
            # past the layer's guard on purpose (it refuses a rotary its config does not describe): the knock-out
            # is meant to make another function
            torch.nn.Module.__setattr__(layer, "rotary", RotaryEmbedding(r.dim, r.theta, interleave=True,
                                                                         scaling=r.scaling))
        if knock.get("attention_sinks") is False:
            layer.sinks = None
    prompt = ids(length=10)
    with torch.no_grad():
        assert max_rel(model(input_ids=prompt).logits, ref(input_ids=prompt).logits) > 1e-3


def test_a_hybrid_keeps_its_linear_attention_layers_and_their_cache_state():
    family = family_named("kimi_linear")
    model = apply_latent_attention(hf_model(family))
    first, second = (layer.self_attn for layer in model.model.layers)
    assert type(first).__name__ == "KimiLinearDeltaAttention" and type(second).__name__ == "LatentAttention"
    with torch.no_grad():
        out = model(input_ids=ids(), use_cache=True)
    cache = getattr(out, CACHE, None) or out.past_key_values
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["LinearAttentionLayer", "LatentCacheLayer"]
    assert cache.get_seq_length() == 6


REFUSED = [f for f in FAMILIES if f.status != "supported"]


@pytest.mark.parametrize("family", REFUSED, ids=[f.model_type for f in REFUSED])
def test_refused_families_are_refused_by_name_and_reason_before_any_work(family):
    cls = model_class(family, taken=False)
    with torch.device("meta"):
        model = cls.__new__(cls)
    torch.nn.Module.__init__(model)
    model.config = types.SimpleNamespace(model_type=family.model_type)
    assert family.reason
    with pytest.raises(ValueError, match=rf"model: {cls.__name__} \('{family.model_type}'\) is not supported "
                                         rf"by apply_latent_attention: {re.escape(family.reason)}"):
        apply_latent_attention(model)


@pytest.mark.parametrize("family", SPARSE_SUPPORTED, ids=[f.model_type for f in SPARSE_SUPPORTED])
def test_the_sparse_selection_is_real(family):
    """The same weights with a top-k covering the whole prompt give other logits, so the parity above
    is over a real subset of the tokens; the first TOPK tokens see every token before them either way."""
    prompt = ids()
    sparse = apply_latent_attention(hf_model(family))
    dense = apply_latent_attention(hf_model(family))
    for layer in latent_layers(dense):
        if layer.indexer is not None:
            layer.indexer.index_topk = prompt.shape[1]
    with torch.no_grad():
        a, b = sparse(input_ids=prompt, use_cache=False).logits, dense(input_ids=prompt, use_cache=False).logits
    assert max_rel(a[:, TOPK:], b[:, TOPK:]) > 1e-2
    assert max_rel(a[:, :TOPK], b[:, :TOPK]) <= 1e-12


def test_glm_dsa_shared_layers_reuse_the_previous_layers_top_k():
    """GLM-5's second layer has no indexer: it attends to the first layer's choice (its third output)."""
    family = family_named("glm_moe_dsa")
    model = apply_latent_attention(hf_model(family))
    first, second = latent_layers(model)
    assert first.indexer is not None and second.indexer is None and second.host.shared_topk
    seen = []
    second.register_forward_hook(lambda mod, args, kwargs, out: seen.append(kwargs["prev_topk_indices"]),
                                 with_kwargs=True)
    chosen = []
    first.register_forward_hook(lambda mod, args, out: chosen.append(out[2]))
    with torch.no_grad():
        model(input_ids=ids(), use_cache=True)
    assert len(seen) == len(chosen) == 1 and seen[0] is chosen[0] and chosen[0].shape == (2, 6, TOPK)


def test_hy_v4s_sinks_and_gate_are_adopted_as_they_are():
    """HY-V4's sinks (kept in float32 by transformers in a bfloat16 model) and its gate_proj are transformers'
    own parameters, shared, not copied or cast, with the QK norm added too; the state dict keeps their names."""
    family = family_named("hy_v4")
    ref = hf_model(family, torch.bfloat16)
    for layer in ref.model.layers:  # as from_pretrained keeps them (_keep_in_fp32_modules_strict)
        layer.self_attn.sinks.data = layer.self_attn.sinks.data.float()
    sinks = [layer.self_attn.sinks for layer in ref.model.layers]
    gates = [layer.self_attn.gate_proj for layer in ref.model.layers]
    keys = set(ref.state_dict())
    model = apply_latent_attention(ref)
    layers = latent_layers(model)
    assert all(layer.sinks is s and s.dtype == torch.float32 for layer, s in zip(layers, sinks))
    assert all(layer.gate_proj is g for layer, g in zip(layers, gates)) and len(layers) == len(sinks)
    assert set(model.state_dict()) == keys
    normed = apply_latent_attention(model, qk_norm="rms")
    assert all(layer.sinks is s for layer, s in zip(latent_layers(normed), sinks))


def test_glm_dsa_of_an_older_transformers_is_refused_naming_its_indexer():
    """Before 5.19 (the CI's 5.4.0) GLM-5's indexer keeps its keys on the module: refused by name, before
    any layer is swapped."""
    family = family_named("glm_moe_dsa")
    model_class(family, taken=False)
    if VERSION >= tuple(int(v) for v in family.taken_since.split(".")[:2]):
        pytest.skip(f"transformers {transformers.__version__}'s GLM-5 indexer is taken (the parity tests run)")
    model = hf_model(family, taken=False)
    with pytest.raises(ValueError, match=r"its indexer GlmMoeDsaIndexer keeps its keys on the module"):
        apply_latent_attention(model)
    assert all(type(layer.self_attn).__name__ == "GlmMoeDsaAttention" for layer in model.model.layers)


def test_an_indexer_called_otherwise_is_refused_naming_its_class():
    """transformers 5.4's GLM-5 indexer keeps its keys on the module (_cached_keys) and takes use_cache:
    refused (named), before any layer is swapped; the CI's 5.4.0 job meets the real one."""
    from qkmla.integrations.transformers.sparse import check_indexer

    class OldIndexer(torch.nn.Module):
        def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, use_cache=False):
            return attention_mask

    with pytest.raises(ValueError, match=r"its indexer OldIndexer takes \('hidden_states', 'q_resid', "
                                         r"'position_embeddings', 'attention_mask', 'use_cache'\)"):
        check_indexer(OldIndexer())
    kept = OldIndexer()
    kept._cached_keys = None
    with pytest.raises(ValueError, match=r"OldIndexer keeps its keys on the module \(_cached_keys\)"):
        check_indexer(kept)


def test_an_mla_family_not_in_the_table_is_refused_naming_it():
    model = hf_model(family_named("deepseek_v3"))
    model.config.model_type = "someone_elses_mla"
    with pytest.raises(ValueError, match="got DeepseekV3ForCausalLM: it has MLA attention \\(DeepseekV3Attention\\), "
                                         "but its family 'someone_elses_mla' is not in qkmla's table"):
        apply_latent_attention(model)
    assert type(model.model.layers[0].self_attn).__name__ == "DeepseekV3Attention"


def test_every_mla_family_of_the_installed_transformers_is_in_the_table():
    """A family transformers adds (its config has kv_lora_rank) must get a row: supported or refused."""
    root = Path(transformers.__file__).parent / "models"
    found = set()
    for path in root.glob("*/configuration_*.py"):
        text = path.read_text()
        if "kv_lora_rank" in text:  # the family's own model type (a wrapper's sub-configs are part of it)
            found.update(t for t in re.findall(r'model_type = "([a-z0-9_]+)"', text) if t == path.parent.name)
    known = {f.model_type for f in FAMILIES}
    assert found and found <= known, sorted(found - known)


def test_the_docs_table_is_the_code_table():
    docs = (Path(__file__).parents[3] / "docs" / "interop.md").read_text()
    assert markdown_table() in docs, "docs/interop.md: paste qkmla.integrations.transformers.families.markdown_table()"


@pytest.mark.parametrize("name", ["glm4_moe_lite", "deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"])
def test_a_qk_normed_model_of_another_family_saves_and_loads_with_its_norm(name, tmp_path):
    """A family's architecture with the QK norm (GLM-4.7-Flash's, and the sparse ones: DeepSeek-V3.2's,
    GLM-5's, HY-V4's with its sinks and gate, AXK2's with its fused query and gate): saved as qkmla's model type of the family, loaded back by the Auto classes and by qkmla's
    from_pretrained, with the norm and the same logits; the family's own class, which does not know
    the norm, refuses the checkpoint naming qkmla's loader."""
    import json

    from qkmla.integrations.hub.record import LOADER
    from qkmla.integrations.transformers import from_pretrained

    family = family_named(name)
    cls = model_class(family)
    model = apply_latent_attention(hf_model(family, torch.float32), qk_norm="rms")
    away_from_ones(latent_layers(model), 0.3)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == f"qkmla_{name}"
    assert config["architectures"] == [f"QKNorm{family.causal_lm}"]
    assert (tmp_path / "modeling_qkmla.py").is_file()
    prompt = ids()
    with torch.no_grad():
        want = model(input_ids=prompt).logits
        plain = apply_latent_attention(hf_model(family, torch.float32))(input_ids=prompt).logits
        for loaded in (transformers.AutoModelForCausalLM.from_pretrained(tmp_path), from_pretrained(tmp_path)):
            assert isinstance(loaded, cls)
            assert type(latent_layers(loaded)[0]) is type(latent_layers(model)[0])
            assert latent_layers(loaded)[0].config.qk_norm == latent_layers(model)[0].config.qk_norm
            assert max_rel(loaded(input_ids=prompt).logits, want) < 1e-6
    assert max_rel(plain, want) > 1e-3  # the norm's weights are what makes them agree
    with pytest.raises(ValueError, match=re.escape(LOADER)):
        cls.from_pretrained(tmp_path)


def test_a_qk_normed_hybrid_saves_and_loads_with_its_norm(tmp_path):
    """Kimi-Linear: only its MLA layers carry the norm, and only theirs are expected back."""
    from qkmla.integrations.transformers import from_pretrained

    family = family_named("kimi_linear")
    model = apply_latent_attention(hf_model(family, torch.float32), qk_norm="rms")
    away_from_ones(latent_layers(model), 0.3)
    model.save_pretrained(tmp_path)
    loaded = from_pretrained(tmp_path)
    prompt = ids()
    with torch.no_grad():
        assert max_rel(loaded(input_ids=prompt).logits, model(input_ids=prompt).logits) < 1e-6


@pytest.mark.parametrize("name", ["glm4_moe_lite", "kimi_linear", "glm_moe_dsa", "hy_v4"])
def test_a_left_padded_batch_generates_as_transformers(name):
    """Padding: the latent layers cache none; a hybrid's linear layers get transformers' own mask;
    GLM-5's indexer is given padding-free columns and its shared layer the first layer's choice."""
    model_class(family_named(name))
    ref = hf_model(family_named(name))
    model = apply_latent_attention(copy.deepcopy(ref))
    prompt = ids(length=7)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0  # the first prompt is 4 tokens, left-padded
    prompt = prompt.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        want, got = ref.generate(prompt, **kw), model.generate(prompt, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        assert max_rel(a, b) < 1e-5



@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa", "hy_v4", "axk2"])
def test_a_padded_batch_without_a_cache_scores_as_transformers(name):
    """Sparse attention on the explicit path (use_cache=False: scoring, training) with padding: each real token
    attends to its indexer's choice only (every real token also saw itself, chosen or not: logits 0.17 off,
    in the unpadded row too), and generate(use_cache=False) gives transformers' tokens."""
    model_class(family_named(name))
    ref = hf_model(family_named(name))
    model = apply_latent_attention(copy.deepcopy(ref))
    prompt = ids(length=7)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    prompt = prompt.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want = ref(prompt, attention_mask=mask, use_cache=False).logits
        got = model(prompt, attention_mask=mask, use_cache=False).logits
        kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=False)
        assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    real = mask.bool()
    assert max_rel(got[real], want[real]) < 1e-6

def test_what_a_family_cannot_take_is_refused_before_any_work():
    from qkmla.integrations.transformers import LatentAttentionCache

    hybrid = apply_latent_attention(hf_model(family_named("kimi_linear")))
    with pytest.raises(ValueError, match="static: this model is a hybrid"):
        LatentAttentionCache(hybrid, max_cache_len=16, static=True)
    mistral = apply_latent_attention(hf_model(family_named("mistral4")))
    with pytest.raises(ValueError, match="position-dependent query scale"), torch.no_grad():
        mistral.generate(ids(), max_new_tokens=2, do_sample=False, cache_implementation="static")


@pytest.mark.parametrize("name", ["kimi_linear", "longcat_flash", "glm_moe_dsa"])
def test_lora_targets_the_mla_projections_only(name):
    """A hybrid's linear-attention o_proj, LongCat-Flash's listed modules and GLM-5's indexer: adapters
    go on the MLA projections alone, every one of them."""
    pytest.importorskip("peft")
    model_class(family_named(name))
    from qkmla.integrations.transformers import attention_lora_config

    model = apply_latent_attention(hf_model(family_named(name)))
    pattern = attention_lora_config(model, targets=("kv_b_proj", "o_proj")).target_modules
    hit = {n for n, _ in model.named_modules() if re.fullmatch(pattern, n)}
    prefixes = {n for n, m in model.named_modules() if m in latent_layers(model)}
    want = {f"{p}.{proj}" for p in prefixes for proj in ("kv_b_proj", "o_proj")}
    assert hit == want


def test_lora_and_qk_clip_refuse_axk2s_fused_query_before_any_work():
    """AXK2's query and output gate come from one fused q_gate_proj: LoRA's targets (q_b_proj) would leave
    its query without an adapter and QK-Clip's rows would scale the gate, so both refuse it, naming why."""
    pytest.importorskip("peft")
    model_class(family_named("axk2"))
    from qkmla.attention.qk_clip import qk_clip_
    from qkmla.integrations.transformers import attention_lora_config

    model = apply_latent_attention(hf_model(family_named("axk2")))
    with pytest.raises(ValueError, match=r"model: its attention takes the query and an output gate from one fused "
                                         r"q_gate_proj \(AXK2\)"):
        attention_lora_config(model)
    layer = latent_layers(model)[0]
    before = {n: p.clone() for n, p in layer.named_parameters()}
    with pytest.raises(ValueError, match="module: .* fused projection without q_b_proj"):
        qk_clip_(layer, torch.full((layer.config.num_heads,), 1e4, dtype=torch.float64), tau=1.0)
    assert all(torch.equal(p, before[n]) for n, p in layer.named_parameters())

