import pytest
import torch

from qkmla.model.generate import generate, sample_next
from qkmla.model.gpt import GPT, GPT_PRESETS


def greedy_without_cache(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        logits, _ = model(torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("attn", ["mla-qknorm", "mla", "gqa-qknorm"])
def test_batched_prompts_of_different_lengths(attn):
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(attn=attn)).double().eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8], [9, 10, 11]]
    got = generate(model, prompts, 6, temperature=0)
    for p, g in zip(prompts, got):
        assert g == greedy_without_cache(model, p, 6)


def test_sampling_options():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, top_k=2, generator=gen)) for _ in range(50)}
    assert draws <= {1, 3} and len(draws) == 2
    assert int(sample_next(logits, 0.0)) == 1
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)
    with pytest.raises(ValueError, match="top_k"):
        sample_next(logits, 1.0, top_k=0)
    model = GPT(GPT_PRESETS["debug"])
    with pytest.raises(ValueError, match="prompts"):
        generate(model, [[]], 3)
