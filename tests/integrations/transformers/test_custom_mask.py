"""Custom 4-D attention masks on a patched model (issue 52, point 8: transformers'
``test_custom_4d_attention_mask``): a shared prefix with branches that do not see each other, with
and without a cache, and decoding on after it, against the unpatched model in float64.

The mask is transformers' [batch, 1, new tokens, all tokens] (bool, or additive float: 0 seen, a
large negative number not); every column is a token. Over a cache the call's tokens are cached
and each attends to the columns its row shows, explicitly over the re-expanded cache.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.integrations.transformers import LatentAttentionCache, apply_latent_attention  # noqa: E402
from qkmla.cache import StreamingLLM  # noqa: E402

from .test_model import CACHE, hf_model, max_rel, patched  # noqa: E402

# transformers' own test data: three sequences that share all but their last token, packed as one
# prefix and three branches (generation/test_utils.py, _get_custom_4d_mask_test_data)
SEQUENCES = torch.tensor([[10, 11, 12, 13], [10, 11, 12, 14], [10, 11, 12, 15]])
TREE = torch.tensor([[10, 11, 12, 13, 14, 15]])
TREE_POSITIONS = torch.tensor([[0, 1, 2, 3, 3, 3]])
TREE_MASK = torch.tensor([[[[1, 0, 0, 0, 0, 0],
                            [1, 1, 0, 0, 0, 0],
                            [1, 1, 1, 0, 0, 0],
                            [1, 1, 1, 1, 0, 0],
                            [1, 1, 1, 0, 1, 0],
                            [1, 1, 1, 0, 0, 1]]]], dtype=torch.bool)


def additive(mask: torch.Tensor) -> torch.Tensor:
    return (~mask).to(torch.float64) * torch.finfo(torch.float64).min


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_a_shared_prefix_tree_gives_each_branch_its_sequences_logits(kind, use_cache):
    ref = hf_model("v3")
    model = patched(ref)
    mask = TREE_MASK if kind == "bool" else additive(TREE_MASK)
    with torch.no_grad():
        alone = ref(SEQUENCES, use_cache=False).logits[:, -1]
        want = ref(TREE, attention_mask=mask, position_ids=TREE_POSITIONS, use_cache=use_cache).logits[0]
        got = model(TREE, attention_mask=mask, position_ids=TREE_POSITIONS, use_cache=use_cache).logits[0]
    assert max_rel(got, want) <= 1e-5
    assert max_rel(got[-3:], alone) <= 1e-5


def test_decoding_on_after_a_tree_matches_transformers():
    """The tree is cached; the next token sees the prefix and the second branch only (a 4-D mask
    over 7 columns), then plain decoding (no mask) sees every cached token, as in transformers."""
    ref = hf_model("v3")
    model = patched(ref)
    step_mask = torch.ones(1, 1, 1, 7, dtype=torch.bool)
    step_mask[..., 3] = step_mask[..., 5] = False
    calls = [dict(input_ids=TREE, attention_mask=TREE_MASK, position_ids=TREE_POSITIONS),
             dict(input_ids=torch.tensor([[20]]), attention_mask=step_mask, position_ids=torch.tensor([[4]])),
             dict(input_ids=torch.tensor([[21]]), position_ids=torch.tensor([[5]]))]
    ref_cache, cache = transformers.DynamicCache(config=ref.config), LatentAttentionCache(model)
    with torch.no_grad():
        for i, call in enumerate(calls):
            want = ref(**call, use_cache=True, **{CACHE: ref_cache}).logits
            got = model(**call, use_cache=True, **{CACHE: cache}).logits
            assert max_rel(got, want) <= 1e-5, i
    assert cache.get_seq_length() == 8


def test_attention_weights_of_a_tree_are_its_mask_pattern():
    model = patched(hf_model("v3"))
    with torch.no_grad():
        out = model(TREE, attention_mask=TREE_MASK, position_ids=TREE_POSITIONS, output_attentions=True,
                    use_cache=True)
    for weights in out.attentions:
        assert weights.shape == (1, 4, 6, 6)
        assert bool((weights[0][:, ~TREE_MASK[0, 0]] == 0).all())
        assert torch.allclose(weights.sum(-1), torch.ones(1, 4, 6, dtype=weights.dtype))


def test_custom_masks_that_cannot_be_served_are_refused_before_any_work():
    model = patched(hf_model("v3"))
    cache = LatentAttentionCache(model)
    with pytest.raises(ValueError, match=r"attention_mask: a 4-D mask must be \[batch=1, 1, 6, 6\]"):
        model(TREE, attention_mask=TREE_MASK[..., :5], **{CACHE: cache})
    with pytest.raises(ValueError, match="attention_mask: a 4-D mask must be bool .* got torch.int64"):
        model(TREE, attention_mask=TREE_MASK.long(), **{CACHE: cache})
    with pytest.raises(ValueError, match="attention_mask: a custom 4-D mask .* static"):
        model(TREE, attention_mask=TREE_MASK, **{CACHE: LatentAttentionCache(model, max_cache_len=16, static=True)})
    assert cache.get_seq_length() == 0
    evicting = apply_latent_attention(patched(hf_model("v3")), policy=StreamingLLM(budget=4, sinks=1))
    with pytest.raises(ValueError, match="attention_mask: a custom 4-D mask .* evict"):
        evicting(TREE, attention_mask=TREE_MASK, use_cache=True)
