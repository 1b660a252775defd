"""A sparse (top-k) selection through MLA's paths: every path attends to exactly the selected slots."""

import pytest
import torch

from qkmla import MLA, LatentCache, MLAConfig
from qkmla.attention.selection import selection_mask


def random_selection(B: int, T: int, past: int, topk: int, seed: int) -> torch.Tensor:
    """[B, T, topk]: for new token t (slot past + t), topk distinct slots among 0..past + t, padded with -1."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        per_token = []
        for t in range(T):
            seen = past + t + 1
            chosen = torch.randperm(seen, generator=g)[:topk]
            per_token.append(torch.cat((chosen, torch.full((topk - len(chosen),), -1))))
        rows.append(torch.stack(per_token))
    return torch.stack(rows)


def test_selection_mask_marks_the_selected_slots_only():
    indices = torch.tensor([[[2, -1, 0], [5, 1, 9]]])  # 9: outside the 6 slots, selects nothing
    assert selection_mask(indices, 6).int().tolist() == [[[1, 0, 1, 0, 0, 0], [0, 1, 0, 0, 0, 1]]]


@pytest.mark.parametrize("qk_norm", [None, "rms"], ids=["plain", "qk-normed"])
def test_absorbed_explicit_and_expand_paths_attend_to_the_same_selection(qk_norm):
    torch.manual_seed(0)
    mla = MLA(MLAConfig(qk_norm=qk_norm)).double().eval()
    if qk_norm is not None:
        with torch.no_grad():
            for qk in (mla.q_norm, mla.k_norm):
                for norm in (qk.content, qk.rope):
                    norm.weight.add_(0.3 * torch.randn_like(norm.weight))
    B, P, topk = 2, 9, 3
    x = torch.randn(B, P + 4, mla.config.hidden_size, dtype=torch.float64)
    prefill = random_selection(B, P, 0, topk, seed=1)
    steps = [random_selection(B, 1, P + i, topk, seed=2 + i) for i in range(3)]
    chunk = random_selection(B, 1, P + 3, topk, seed=9)
    caches = {p: LatentCache.from_config(mla.config, B, 32, dtype=torch.float64) for p in ("absorbed", "expand")}
    outs = {}
    for path, cache in caches.items():
        got = [mla(x[:, :P], cache, indices=prefill)]  # the explicit prefill, selection masked
        for i, indices in enumerate(steps + [chunk]):
            got.append(mla(x[:, P + i:P + i + 1], cache, indices=indices, path=path))
        outs[path] = torch.cat(got, dim=1)
    torch.testing.assert_close(outs["absorbed"], outs["expand"], rtol=1e-10, atol=1e-12)
    # The selection matters: the dense decode gives other outputs.
    dense = LatentCache.from_config(mla.config, B, 32, dtype=torch.float64)
    mla(x[:, :P], dense, indices=prefill)
    assert (mla(x[:, P:P + 1], dense) - outs["absorbed"][:, P:P + 1]).abs().max() > 1e-3


def test_indices_of_the_wrong_shape_are_refused_naming_them():
    mla = MLA(MLAConfig()).eval()
    cache = LatentCache.from_config(mla.config, 2, 16)
    x = torch.randn(2, 3, mla.config.hidden_size)
    with pytest.raises(ValueError, match=r"indices: expected an int32/int64 tensor \[B=2, T=3, topk >= 1\]"):
        mla(x, cache, indices=torch.zeros(2, 4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="indices: a sparse selection names latent cache slots"):
        mla(x, None, indices=torch.zeros(2, 3, 2, dtype=torch.long))
