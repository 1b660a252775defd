"""Position ids on a patched model with a cache: any that transformers accepts, as its own attention
takes them (issue 52, points 5 and 8).

The latent cache stores each token's RoPE key rotated to the position transformers gave it, so
attention sees the position differences transformers' attention sees, whatever the numbering:
``generate``'s on a right-padded batch (padding numbered 1, the first decode step at a position
that skips none of the padding columns), a row of padding only, a caller's own jumps, repeats and
steps back, and none at all (transformers then numbers the columns, padding included).

Every comparison is with the unpatched model, float64, on the tiny random models of
``test_model.py``: greedy tokens equal, logits of the real tokens within 1e-5 of the largest.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from qkmla.integrations.transformers import LatentAttentionCache  # noqa: E402

from .test_model import CACHE, hf_model, max_rel, patched, prompts  # noqa: E402


def right_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, p in enumerate(rows):
        ids[b, :len(p)], mask[b, :len(p)] = p, 1
    return ids, mask


def visible_pad_token(model):
    """The pad token's embedding made nonzero (this random model's is a zero padding_idx row), so a
    row of padding says something and a wrong position shows."""
    with torch.no_grad():
        model.model.embed_tokens.weight[0].normal_()
    return model


@pytest.mark.parametrize("variant", ["v3", "v2-lite-yarn"])
def test_right_padded_generate_matches_transformers(variant):
    """Right padding, and a row of padding only: generate numbers the padding 1 and the first decode
    step at the column count's cumsum - 1, which the cache once refused (its slot count is smaller)."""
    ref = visible_pad_token(hf_model(variant))
    model = patched(ref)
    ids, mask = right_padded(prompts([7, 3, 1, 5]))
    ids[2], mask[2] = 0, 0  # a row of padding only
    kw = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want, got = ref.generate(ids, attention_mask=mask, **kw), model.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        assert max_rel(a, b) <= 1e-5, (step, max_rel(a, b))


def run_calls(model, calls, cache=None) -> list[torch.Tensor]:
    """Each call (input_ids [B, T], attention_mask over every column so far, position_ids or None)
    through ``model`` on one cache; the logits of every call."""
    logits = []
    with torch.no_grad():
        for ids, mask, positions in calls:
            kw = {CACHE: cache} if cache is not None else {}
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **kw)
            cache = getattr(out, CACHE, None) or out.past_key_values
            logits.append(out.logits)
    return logits


def calls_with_positions(numbered: bool):
    """A padded prefill (left padding, a hole inside a row, a row of padding only) and three later
    calls (one token, two tokens, one token). ``numbered``: position ids that jump, repeat and go
    back; else None, which transformers turns into the column numbers."""
    ids = torch.stack(prompts([6, 6, 6]))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[1, 3] = 0  # a hole inside the row
    mask[2] = 0  # padding only
    positions = torch.tensor([[0, 0, 5, 6, 9, 9], [3, 2, 1, 1, 1, 40], [1, 1, 1, 1, 1, 1]])
    calls = [(ids, mask, positions if numbered else None)]
    later = [(1, [[10], [41], [0]]), (2, [[11, 30], [12, 13], [7, 3]]), (1, [[31], [2], [20]])]
    for n, step_positions in later:
        mask = torch.cat([mask, torch.ones(3, n, dtype=torch.long)], dim=1)
        new = torch.stack(prompts([n, n, n], seed=10 + n))
        calls.append((new, mask, torch.tensor(step_positions) if numbered else None))
    return calls


@pytest.mark.parametrize("numbered", [True, False], ids=["own-numbering", "none"])
@pytest.mark.parametrize("variant", ["v3", "v2-lite-yarn"])
def test_any_position_ids_with_a_cache_match_transformers(variant, numbered):
    ref = visible_pad_token(hf_model(variant))
    model = patched(ref)
    calls = calls_with_positions(numbered)
    want = run_calls(ref, calls)
    got = run_calls(model, calls, LatentAttentionCache(model))
    for i, ((ids, mask, _), a, b) in enumerate(zip(calls, got, want)):
        real = mask[:, -ids.shape[1]:].bool()
        assert max_rel(a[real], b[real]) <= 1e-5, (i, max_rel(a[real], b[real]))


def test_position_ids_of_another_shape_are_refused_before_any_work():
    model = patched(hf_model("v3"))
    ids = torch.stack(prompts([5, 5]))
    cache = LatentAttentionCache(model)
    for bad, match in [(torch.arange(5)[None].expand(3, 5), r"expected shape \[batch=2, 5\]"),
                       (torch.arange(4)[None], r"expected shape \[batch=2, 5\]"),
                       (torch.arange(5.0)[None], "expected an integer tensor")]:
        with pytest.raises(ValueError, match=f"position_ids: {match}"):
            model(input_ids=ids, position_ids=bad, **{CACHE: cache})
        assert cache.get_seq_length() == 0
