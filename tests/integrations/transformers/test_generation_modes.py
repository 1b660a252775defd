"""transformers' other generation modes on a patched model: continuous batching, the attention
switch it asks for, static and offloaded caches (issue 52).

Served: ``cache_implementation="offloaded"`` (each latent layer's rows go to CPU memory after the
layer's step and come back before its next), with ``generate``'s tokens; a ``StaticCache``
passed becomes a static latent cache (``test_static.py`` tests ``cache_implementation="static"``).
Refused before any work, naming what works: continuous batching (``generate_batch``,
``init_continuous_batching``, ``continuous_batching_context_manager``), ``set_attn_implementation``
to anything but qkmla's latent attention, and ``cache_implementation="offloaded_static"``.

Models are the tiny random DeepSeek-V3 models of ``test_model.py``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.integrations.transformers import LatentAttentionCache, apply_latent_attention  # noqa: E402
from qkmla.integrations.transformers.cache import LatentCacheLayer  # noqa: E402

from .test_model import CACHE, hf_model, left_padded, patched, prompts  # noqa: E402

NEW = 4


@pytest.fixture(scope="module")
def model():
    return patched(hf_model(dtype=torch.float32))


def padded_batch():
    return left_padded(prompts([5, 7, 3]))


def greedy(model, **kwargs) -> torch.Tensor:
    ids, mask = padded_batch()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **kwargs)
    return out[:, ids.shape[1]:]


class Forwards:
    """Counts the decoder layers' forwards (none run when a call is refused before any work)."""

    def __init__(self, model):
        self.count = 0
        self.handles = [layer.register_forward_pre_hook(self._count) for layer in model.model.layers]

    def _count(self, *args):
        self.count += 1

    def remove(self):
        for handle in self.handles:
            handle.remove()


# -- continuous batching and the switch to sdpa ------------------------------------------------

ENTRY_POINTS = {
    "generate_batch": lambda m, cfg: m.generate_batch([[5, 6, 7], [8, 9]], generation_config=cfg),
    "init_continuous_batching": lambda m, cfg: m.init_continuous_batching(generation_config=cfg),
    "continuous_batching_context_manager": lambda m, cfg: m.continuous_batching_context_manager(
        generation_config=cfg).__enter__(),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_continuous_batching_is_refused_before_any_work_naming_generate(model, entry):
    forwards = Forwards(model)
    cfg = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1)
    try:
        with pytest.raises(ValueError, match=r"generate_batch: transformers' continuous batching .*not supported.*"
                                             r"Use model\.generate on a padded batch"):
            ENTRY_POINTS[entry](model, cfg)
    finally:
        forwards.remove()
    assert forwards.count == 0
    assert model.config._attn_implementation == "qkmla_latent"


def test_switching_to_sdpa_is_refused_and_continuous_batching_never_ends_in_empty_outputs():
    """transformers' advice for continuous batching (switch to sdpa) is refused; forced anyway,
    generate_batch still refuses instead of returning {'req_0': [], ...}."""
    model = patched(hf_model(dtype=torch.float32))
    expected = greedy(model)
    for implementation in ("sdpa", "eager", {"": "sdpa"}):
        with pytest.raises(ValueError, match=r"attn_implementation: this model attends through qkmla's latent "
                                             r"attention layers .*model\.generate"):
            model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == "qkmla_latent"
    model.set_attn_implementation("qkmla_latent")  # what it has: nothing to do
    cfg = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1)
    type(model).set_attn_implementation(model, "sdpa")  # the class's own method, around the refusal
    with pytest.raises(ValueError, match="generate_batch: "):
        model.generate_batch([[5, 6, 7], [8, 9]], generation_config=cfg)
    assert torch.equal(greedy(model), expected)  # the latent layers still run generate


def test_a_causal_lm_whose_inner_model_was_patched_is_guarded_once_applied_to_itself_too():
    lm = hf_model(dtype=torch.float32)
    apply_latent_attention(lm.model)
    assert "init_continuous_batching" not in vars(lm)  # the inner model's call cannot reach the causal LM
    apply_latent_attention(lm)
    with pytest.raises(ValueError, match="generate_batch: "):
        lm.init_continuous_batching()


def test_another_model_keeps_transformers_continuous_batching_and_switch(model):
    """The refusals are set on the patched instance only: a stock model of the same class switches."""
    stock = hf_model(dtype=torch.float32)
    stock.set_attn_implementation("sdpa")
    assert stock.config._attn_implementation == "sdpa"
    assert "init_continuous_batching" not in vars(stock)


# -- static caches -----------------------------------------------------------------------------

def test_offloaded_static_is_refused_naming_it_before_any_work(model):
    forwards = Forwards(model)
    try:
        with pytest.raises(ValueError, match=r"cache_implementation: the \w+ is an offloading static cache "
                                             r"\(cache_implementation=\"offloaded_static\"\)"):
            greedy(model, cache_implementation="offloaded_static")
    finally:
        forwards.remove()
    assert forwards.count == 0


def test_a_static_cache_passed_becomes_a_static_latent_cache_and_a_fixed_capacity_one_generates(model):
    ids, mask = padded_batch()
    static = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + NEW)
    assert torch.equal(greedy(model, **{CACHE: static}), greedy(model))
    assert all(type(layer).__name__ == "StaticLatentCacheLayer" for layer in static.layers)
    fixed = LatentAttentionCache(model, max_cache_len=ids.shape[1] + NEW)
    assert torch.equal(greedy(model, **{CACHE: fixed}), greedy(model))


# -- offloading --------------------------------------------------------------------------------

@pytest.fixture
def moves(monkeypatch):
    """Every LatentCacheLayer.offload / prefetch call, as (name, layer id)."""
    calls = []
    for name in ("offload", "prefetch"):
        method = getattr(LatentCacheLayer, name)

        def spy(self, method=method, name=name):
            calls.append((name, id(self)))
            return method(self)
        monkeypatch.setattr(LatentCacheLayer, name, spy)
    return calls


def test_offloaded_generation_offloads_every_latent_layer_after_each_step_and_matches(model, moves):
    expected = greedy(model)
    assert moves == []  # a cache that does not offload never moves its rows
    ids, mask = padded_batch()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             cache_implementation="offloaded", return_dict_in_generate=True)
    assert torch.equal(out.sequences[:, ids.shape[1]:], expected)
    layers = out.past_key_values.layers
    forwards = NEW  # the prefill and NEW - 1 decode steps
    for layer in layers:
        mine = [name for name, who in moves if who == id(layer)]
        # each forward: back before the layer reads its rows (not the first: nothing cached yet), away after
        assert mine == ["offload"] + ["prefetch", "offload"] * (forwards - 1), mine
        assert all(b.data.device.type == "cpu" for b in layer.latent.fields.values())
    assert all(isinstance(layer, LatentCacheLayer) and layer.offloading for layer in layers)


def test_an_offloading_latent_cache_passed_matches_and_moves_its_rows_back(model, moves):
    expected = greedy(model)
    cache = LatentAttentionCache(model, offloading=True)
    assert torch.equal(greedy(model, **{CACHE: cache}), expected)
    assert len(moves) == 2 * NEW * len(cache.layers) - len(cache.layers)
    layer = cache.layers[0]
    rows = {name: b.data.clone() for name, b in layer.latent.fields.items()}
    layer.prefetch()
    assert not layer.is_offloaded
    assert all(torch.equal(b.data, rows[name]) for name, b in layer.latent.fields.items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="offloading is observable only off the CPU")
def test_offloaded_rows_leave_the_gpu_between_steps():
    model = patched(hf_model(dtype=torch.float32), decode_backend="torch").cuda()
    ids, mask = (t.cuda() for t in padded_batch())
    with torch.no_grad():
        plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             cache_implementation="offloaded", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    layers = out.past_key_values.layers
    assert all(layer.is_offloaded for layer in layers)
    assert all(b.data.device.type == "cpu" for layer in layers for b in layer.latent.fields.values())
    layers[0].prefetch()
    torch.cuda.synchronize()
    assert not layers[0].is_offloaded and layers[0].latent.fields["latent"].data.is_cuda
