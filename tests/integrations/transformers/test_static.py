"""The static latent cache (``static.py``) and transformers' compile path (issue 52, point 6).

``generate(..., cache_implementation="static")`` and ``LatentAttentionCache(model, max_cache_len=N,
static=True)`` decode with the growing cache's tokens and logits; a compiled decode step breaks
its graph nowhere inside attention (the patched model's breaks are the stock model's, all in
transformers' MoE loop), a compiled attention layer traces whole (``fullgraph=True``), and one
graph serves every step (no recompile per step); ``output_attentions=True`` gives the unpatched
model's weights over its own static cache, and compiled steps give the eager steps' weights. Settings
a static cache cannot hold are refused
by name before any work. The graphs are compiled with the ``eager`` backend: dynamo's tracing
is what decides graph breaks; inductor's code generation would only cost the suite minutes.

Models are the tiny random DeepSeek-V3 models of ``test_model.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.cache import SnapKV  # noqa: E402
from qkmla.integrations.hub.record import recorded_norm  # noqa: E402
from qkmla.integrations.transformers import LatentAttentionCache  # noqa: E402
from qkmla.integrations.transformers.static import StaticLatentCacheLayer  # noqa: E402

from .test_model import CACHE, hf_model, left_padded, patched, prompts  # noqa: E402

NEW = 5
QK_NORMS = [None, "rms", "l2"]


@pytest.fixture(scope="module")
def stock():
    return hf_model(dtype=torch.float64)


@pytest.fixture(scope="module", params=QK_NORMS, ids=lambda n: f"qk_norm={n}")
def model(request, stock):
    return patched(stock, qk_norm=request.param)


@pytest.fixture(scope="module")
def normed(stock):
    """The compile tests' model: a QK RMSNorm, so the key scalars are in the graph too."""
    return patched(stock, qk_norm="rms")


def padded_batch():
    return left_padded(prompts([5, 7, 3]))


def generate(model, **kwargs):
    ids, mask = padded_batch()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, dim=1)


def test_static_generation_matches_the_growing_cache_and_stock_transformers(model, stock):
    tokens, logits = generate(model)
    static_tokens, static_logits = generate(model, cache_implementation="static")
    assert torch.equal(static_tokens, tokens)
    torch.testing.assert_close(static_logits, logits, rtol=0, atol=1e-10)
    if recorded_norm(model.config) is None:  # no norm: the stock model's function
        assert torch.equal(static_tokens, generate(stock)[0])


def test_a_static_latent_cache_passed_matches_and_is_compileable(model):
    ids, _ = padded_batch()
    cache = LatentAttentionCache(model, max_cache_len=ids.shape[1] + NEW, static=True)
    assert cache.is_compileable and all(isinstance(layer, StaticLatentCacheLayer) for layer in cache.layers)
    tokens, logits = generate(model, **{CACHE: cache})
    assert torch.equal(tokens, generate(model)[0])
    assert int(cache.get_seq_length()) == ids.shape[1] + NEW - 1  # the last token is never fed back


def test_beam_search_over_a_static_cache_matches_the_growing_cache(normed):
    model = normed
    ids, mask = padded_batch()
    with torch.no_grad():
        beams = [model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_beams=3, do_sample=False,
                                **kwargs) for kwargs in ({}, {"cache_implementation": "static"})]
    assert torch.equal(beams[0], beams[1])


def decode_inputs(model, cache_kind: str):
    """A prefilled static cache of the padded batch and the next step's keyword arguments, as
    ``generate`` passes them (no mask: its new tokens are real; positions from the mask)."""
    ids, mask = padded_batch()
    cache = (LatentAttentionCache(model, max_cache_len=32, static=True) if cache_kind == "latent"
             else transformers.StaticCache(config=model.config, max_cache_len=32))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{CACHE: cache})
    step = dict(input_ids=out.logits[:, -1:].argmax(-1), position_ids=mask.sum(dim=1, keepdim=True), use_cache=True,
                **{CACHE: cache})
    if cache_kind != "latent":  # transformers' own static path needs its mask, a fixed-width one
        full = torch.nn.functional.pad(torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1), (0, 32 - ids.shape[1] - 1))
        step["attention_mask"] = full
    return step


def breaks(model, kwargs) -> tuple[int, list]:
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(**kwargs)
    frames = [frame.filename for b in explained.break_reasons for frame in b.user_stack]
    return explained.graph_break_count, frames


def test_a_compiled_decode_step_breaks_no_graph_inside_attention(normed, stock):
    count, frames = breaks(normed, decode_inputs(normed, "latent"))
    stock_count, _ = breaks(stock, decode_inputs(stock, "stock"))
    assert count <= stock_count
    assert not [f for f in frames if "qkmla" in f or "attention" in f]


def test_a_compiled_attention_layer_traces_whole_and_one_graph_serves_every_step(normed):
    model = normed
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    step = decode_inputs(model, "latent")
    cache, layer = step[CACHE], model.model.layers[0]
    attention = layer.self_attn
    counter = CompileCounter()
    compiled = torch.compile(attention, backend=counter, fullgraph=True, dynamic=False)
    hidden = torch.randn(3, 1, model.config.hidden_size, dtype=torch.float64)
    positions = step["position_ids"]
    with torch.no_grad():
        for k in range(3):
            before = cache.layers[0].latent.clone(), cache.layers[0].length.clone()
            out, _ = compiled(hidden, position_ids=positions + k, **{CACHE: cache})
            after = cache.layers[0].latent.clone(), cache.layers[0].length.clone()
            cache.layers[0].latent.copy_(before[0]), cache.layers[0].length.copy_(before[1])
            expected, _ = attention(hidden, position_ids=positions + k, **{CACHE: cache})
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
            assert torch.equal(cache.layers[0].latent, after[0]) and torch.equal(cache.layers[0].length, after[1])
    assert counter.frame_count == 1


def static_attentions(model, ids, mask, **kwargs):
    """``generate`` over a static cache, asked for the attention weights (3 new tokens unless told)."""
    kwargs = {"max_new_tokens": 3, **kwargs}
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, cache_implementation="static",
                              output_attentions=True, return_dict_in_generate=True, **kwargs)


def test_generate_through_transformers_compile_path_matches_eager(normed):
    """Tokens and logits as the growing cache's; asked for all outputs, as transformers'
    ``test_generate_compilation_all_outputs`` asks, the compiled steps' attention weights are the
    eager static steps' (one compiled run serves both checks: compiling is the suite's cost)."""
    model = normed
    config = transformers.CompileConfig(backend="eager", fullgraph=False, dynamic=False)
    config._compile_all_devices = True  # transformers compiles on a CPU only when told
    torch._dynamo.reset()
    ids, mask = padded_batch()
    compiled = static_attentions(model, ids, mask, max_new_tokens=NEW, compile_config=config, output_logits=True,
                                 output_hidden_states=True)
    assert hasattr(model, "_compiled_call")  # the decode steps ran compiled
    eager_tokens, eager_logits = generate(model)
    assert torch.equal(compiled.sequences[:, ids.shape[1]:], eager_tokens)
    torch.testing.assert_close(torch.stack(compiled.logits, dim=1), eager_logits, rtol=0, atol=1e-10)
    reference = static_attentions(model, ids, mask, max_new_tokens=NEW)
    assert len(compiled.attentions) == NEW
    for c, r in zip(compiled.attentions, reference.attentions):
        torch.testing.assert_close(torch.stack(c), torch.stack(r), rtol=0, atol=1e-10)


def test_output_attentions_over_a_static_cache_are_the_stock_models_weights(stock):
    """The weights in transformers' static layout [B, h, T, max_cache_len], against the unpatched
    model's eager attention over its own static cache (the row without padding: eager's padding
    query rows are NaN). Compiled steps' weights: the compile-path test above."""
    eager = copy.deepcopy(stock)
    eager.set_attn_implementation("eager")  # the stock attention that returns weights
    model = patched(eager)
    ids, mask = left_padded(prompts([6, 8]))
    want, got = static_attentions(eager, ids[1:], mask[1:]), static_attentions(model, ids, mask)
    assert torch.equal(got.sequences[1:], want.sequences)
    assert len(got.attentions) == len(want.attentions) == 3
    for step, (w, g) in enumerate(zip(want.attentions, got.attentions)):
        for w_layer, g_layer in zip(w, g):
            assert g_layer.shape == (2, *w_layer.shape[1:])
            assert g_layer.shape[-1] == 8 + 3 - 1  # the capacity generate sizes: the last token is never fed back
            torch.testing.assert_close(g_layer[1:], w_layer, rtol=0, atol=1e-6)
            assert float(g_layer[0, ..., :2].abs().max()) == 0.0  # row 0's two padding columns
            assert float(g_layer[..., 8 + step:].abs().sum()) == 0.0  # columns not yet written
            torch.testing.assert_close(g_layer.sum(-1)[0, :, -1], torch.ones_like(g_layer[0, :, -1, 0]))


# -- refused ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain(stock):
    return patched(stock)


@pytest.mark.parametrize("kwargs, match", [
    ({}, r"^max_cache_len: a static latent cache needs a positive int capacity"),
    ({"max_cache_len": 0}, r"^max_cache_len: a static latent cache needs a positive int"),
    ({"max_cache_len": 16, "kv_format": "fp8"}, r"^kv_format: a static \(compileable\) latent cache stores dense rows"),
    ({"max_cache_len": 16, "policy": SnapKV(kept_fraction=0.5)}, r"^policy: a static \(compileable\) latent cache"),
    ({"max_cache_len": 16, "offloading": True}, r"^offloading: a static latent cache keeps its fixed buffers"),
    ({"max_cache_len": 16, "static": 1}, r"^static: expected True"),
])
def test_a_static_cache_it_cannot_hold_is_refused_naming_the_argument(plain, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LatentAttentionCache(plain, **{"static": True, **kwargs})


def test_static_generation_of_a_model_set_to_fp8_rows_is_refused_before_any_work(stock):
    model = patched(stock, kv_format="fp8")
    with pytest.raises(ValueError, match=r"^kv_format: a static \(compileable\) latent cache stores dense rows"):
        generate(model, cache_implementation="static")


def test_more_tokens_than_the_capacity_are_refused_before_any_write(plain):
    ids, mask = padded_batch()
    cache = LatentAttentionCache(plain, max_cache_len=ids.shape[1] - 1, static=True)
    with pytest.raises(ValueError, match=r"^max_cache_len: this static latent cache holds 6 columns per sequence and "
                                         r"this call needs 7"):
        plain(input_ids=ids, attention_mask=mask, use_cache=True, **{CACHE: cache})
    assert int(cache.get_seq_length()) == 0


def _grad_model():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from qkmla.integrations.transformers import apply_latent_attention

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                           num_experts_per_tok=2, n_group=1, topk_group=1)
    return apply_latent_attention(DeepseekV3ForCausalLM(cfg)).double()


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
def test_a_decode_step_trained_through_either_cache_has_the_explicit_gradient(static):
    """Training mode: the last token's loss through a decode step. Over the static cache kv_b_proj got
    no gradient at all (the kept absorbed weights, derived without autograd), silently."""
    model = _grad_model().train()
    ids = torch.randint(0, 64, (1, 7))
    model(ids, use_cache=False).logits[:, -1].square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    cache = LatentAttentionCache(model, max_cache_len=8, static=True) if static else LatentAttentionCache(model)
    model(ids[:, :6], past_key_values=cache, use_cache=True)
    model(ids[:, 6:], past_key_values=cache, use_cache=True).logits[:, -1].square().sum().backward()
    for name, g in want.items():
        got = dict(model.named_parameters())[name].grad
        assert got is not None, name
        torch.testing.assert_close(got, g, rtol=1e-8, atol=1e-12, msg=name)


def test_a_compiled_training_step_after_a_no_grad_prefill_has_the_eager_gradient():
    """A prefill under no_grad keeps the absorbed weights (derived without autograd); a compiled decode step
    trained through then read those kept ones, where an eager step derives them afresh: kv_b_proj got no
    gradient at all, silently. The compiled step's gradients are now the eager step's."""
    torch._dynamo.reset()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(1))
    grads = []
    for compiled in (False, True):
        model = _grad_model().train()
        cache = LatentAttentionCache(model, max_cache_len=8, static=True)
        with torch.no_grad():
            model(ids[:, :6], past_key_values=cache, use_cache=True)
        attn = model.model.layers[0].self_attn
        assert attn._absorbed.weights is not None  # the kept weights a compiled step could read
        if compiled:
            attn.forward = torch.compile(attn.forward, backend="aot_eager", fullgraph=True)
        model(ids[:, 6:], past_key_values=cache, use_cache=True).logits[:, -1].square().sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    eager, compiled = grads
    assert "model.layers.0.self_attn.kv_b_proj.weight" in eager and eager.keys() == compiled.keys()
    for name, g in eager.items():
        torch.testing.assert_close(compiled[name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_training_steps_over_a_reset_static_cache_have_the_explicit_gradient():
    """Probe 14b T07: a training step through a static cache, its backward, ``cache.reset()`` and a second step failed
    in the second backward ("Trying to backward through the graph a second time"): reset() zeroed the buffers in
    place, keeping the first step's graph, which the second step's writes chained onto. reset() drops it now, in
    place (the buffers keep their addresses for a compiled step)."""
    model = _grad_model().train()
    ids = torch.randint(0, 64, (1, 7))
    model(ids, use_cache=False).logits[:, -1].square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    cache = LatentAttentionCache(model, max_cache_len=8, static=True)
    for step in range(2):
        model.zero_grad()
        cache.reset()
        model(ids[:, :6], past_key_values=cache, use_cache=True)
        if step == 0:
            address = cache.layers[0].latent.data_ptr()
        model(ids[:, 6:], past_key_values=cache, use_cache=True).logits[:, -1].square().sum().backward()
        for name, g in want.items():
            torch.testing.assert_close(dict(model.named_parameters())[name].grad, g, rtol=1e-8, atol=1e-12,
                                       msg=f"{step} {name}")
    assert cache.layers[0].latent.data_ptr() == address


def test_a_static_cache_filled_under_inference_mode_is_refused_outside_it():
    """Probe 14b: a static cache first filled under ``torch.inference_mode()`` and continued outside it (under
    ``torch.no_grad()``) failed deep in the write with torch's "Inplace update to inference tensor outside
    InferenceMode is not allowed", naming no cache; refused now naming cache, before any write."""
    model = _grad_model().eval()
    ids = torch.randint(0, 64, (1, 7))
    cache = LatentAttentionCache(model, max_cache_len=8, static=True)
    with torch.inference_mode():
        model(ids[:, :6], past_key_values=cache, use_cache=True)
    with torch.no_grad(), pytest.raises(ValueError, match=r"^cache: its buffers were made under "
                                                          r"torch.inference_mode\(\).*torch.no_grad\(\) is not"):
        model(ids[:, 6:], past_key_values=cache, use_cache=True)
    assert int(cache.get_seq_length()) == 6
    with torch.inference_mode():
        model(ids[:, 6:], past_key_values=cache, use_cache=True)
    assert int(cache.get_seq_length()) == 7


def test_a_crop_that_drops_nothing_is_taken_outside_inference_mode():
    """Review 15: the refusal of writes outside inference mode (bc7ca99) came before crop's 'nothing to drop', so
    crop(0), crop(n >= length) of a static cache filled under inference mode were refused, where they had run (and
    the growing cache runs them). A crop that drops columns is still refused, before any write."""
    model = _grad_model().eval()
    ids = torch.randint(0, 64, (1, 6))
    cache = LatentAttentionCache(model, max_cache_len=8, static=True)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
    for tokens in (0, 6, 7, -0):
        cache.crop(tokens)
        assert int(cache.get_seq_length()) == 6
    with pytest.raises(ValueError, match=r"crop it inside torch.inference_mode\(\)"):
        cache.crop(3)
    assert int(cache.get_seq_length()) == 6


def test_a_rebuilt_model_that_takes_the_rows_over_is_the_one_the_view_expands_with():
    """Review 15: each cache layer keeps a weak reference to the attention that wrote it, for its transformers view
    (layer.keys / .values), set only while it was None: after release_writer() handed the rows to a rebuilt model
    (the first one freed), the dead reference stayed and layer.keys was None for good; after reset() the new writer
    was not the one the view expanded keys with. Both forget it now."""
    import gc

    ids = torch.randint(0, 64, (1, 6))
    for static in (False, True):
        a = _grad_model().eval()
        cache = LatentAttentionCache(a, max_cache_len=8, static=static)
        with torch.no_grad():
            a(ids[:, :5], past_key_values=cache, use_cache=True)
            assert cache.layers[0].keys is not None
            state = copy.deepcopy(a.state_dict())
            del a
            gc.collect()
            b = _grad_model().eval()
            b.load_state_dict(state)
            cache.release_writer()
            b(ids[:, 5:], past_key_values=cache, use_cache=True)
            assert cache.layers[0].attention() is b.model.layers[0].self_attn and cache.layers[0].keys is not None
            cache.reset()
            c = copy.deepcopy(b)
            c(ids, past_key_values=cache, use_cache=True)
            assert cache.layers[0].attention() is c.model.layers[0].self_attn


def test_a_static_cache_made_or_filled_under_inference_mode_resets_and_runs_outside_it():
    """Review 14: a static cache constructed under ``torch.inference_mode()`` and first used under no_grad failed
    in torch's "Inplace update to inference tensor" (its length counter, made at construction, an inference
    tensor); one filled there and reset outside it failed the same way in reset(), the way out the refusal
    names. Both now run, and decode as a cache that never saw inference mode; a reset inside a fullgraph-compiled
    region after a training prefill traces."""
    model = _grad_model().eval()
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(2))

    def decode(cache):
        with torch.no_grad():
            model(ids[:, :6], past_key_values=cache, use_cache=True)
            return model(ids[:, 6:], past_key_values=cache, use_cache=True).logits

    want = decode(LatentAttentionCache(model, max_cache_len=8, static=True))
    with torch.inference_mode():
        made_there = LatentAttentionCache(model, max_cache_len=8, static=True)
    torch.testing.assert_close(decode(made_there), want, rtol=0, atol=0)
    filled_there = LatentAttentionCache(model, max_cache_len=8, static=True)
    with torch.inference_mode():
        model(ids[:, :6], past_key_values=filled_there, use_cache=True)
    filled_there.reset()
    assert int(filled_there.get_seq_length()) == 0
    torch.testing.assert_close(decode(filled_there), want, rtol=0, atol=0)

    model.train()
    trained = LatentAttentionCache(model, max_cache_len=8, static=True)
    model(ids[:, :6], past_key_values=trained, use_cache=True)
    assert trained.layers[0].latent.grad_fn is not None  # the history a compiled reset cannot read
    torch.compile(trained.layers[0].reset, backend="eager", fullgraph=True)()
    assert int(trained.layers[0].length) == 0


def test_an_eval_static_decode_step_refuses_its_backward():
    model = _grad_model().eval()
    ids = torch.randint(0, 64, (1, 7))
    cache = LatentAttentionCache(model, max_cache_len=8, static=True)
    model(ids[:, :6], past_key_values=cache, use_cache=True)
    out = model(ids[:, 6:], past_key_values=cache, use_cache=True).logits
    with pytest.raises(RuntimeError, match=r"^attention: an MLA decode step in eval mode is inference"):
        out.sum().backward()


def test_an_eval_static_decode_loop_outside_no_grad_keeps_no_graph():
    model = _grad_model().eval()
    ids = torch.randint(0, 64, (1, 12))
    cache = LatentAttentionCache(model, max_cache_len=16, static=True)
    with torch.no_grad():
        model(ids[:, :6], past_key_values=cache, use_cache=True)
    for t in range(6, 12):
        model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    assert not layer.latent.requires_grad and (layer.key_scale is None or not layer.key_scale.requires_grad)
