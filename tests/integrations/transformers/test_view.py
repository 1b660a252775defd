"""A latent cache's ``keys`` and ``values`` in transformers' layout (``view.py``; issue 52, point 8:
transformers' ``_check_past_key_values_for_generate``): equal, at every real column, to what the
unpatched model's own cache holds after the same ``generate``, float64; padding columns zero."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.integrations.transformers import LatentAttentionCache  # noqa: E402

from .test_model import hf_model, left_padded, max_rel, patched, prompts  # noqa: E402


@pytest.mark.parametrize("variant, cache_implementation", [("v3", None), ("v3", "static"), ("v2", None)])
def test_keys_and_values_are_transformers_own_after_generate(variant, cache_implementation):
    ref = hf_model(variant)
    model = patched(ref)
    ids, mask = left_padded(prompts([3, 6]))
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    want = ref.generate(ids, **kw, cache_implementation=cache_implementation).past_key_values
    got = model.generate(ids, **kw, cache_implementation=cache_implementation).past_key_values
    columns = ids.shape[1] + 2  # the last new token is not cached yet
    real = torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], dim=1).bool()
    for ours, theirs in zip(got.layers, want.layers):
        for name in ("keys", "values"):
            a, b = getattr(ours, name)[:, :, :columns], getattr(theirs, name)[:, :, :columns]
            assert a.shape == b.shape, name
            assert max_rel(a.transpose(1, 2)[real], b.transpose(1, 2)[real]) <= 1e-6, name
            assert bool((a.transpose(1, 2)[~real] == 0).all()), name


def test_an_unwritten_layer_has_none_and_the_view_cannot_be_assigned():
    model = patched(hf_model("v3"))
    cache = LatentAttentionCache(model)
    assert cache.layers[0].keys is None and cache.layers[0].values is None
    with pytest.raises(ValueError, match="cache: a latent cache layer's keys are computed"):
        cache.layers[0].keys = torch.zeros(1)
