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


def greedy_sliding_without_cache(model, prompt, n):
    """The window rule spelled out with full forwards: the model sees at most block_size
    tokens; when the window overflows, its last block_size // 2 tokens go on."""
    context = model.config.block_size
    window, out = list(prompt)[-(context - 1):], []
    for _ in range(n):
        logits, _ = model(torch.tensor([window]))
        out.append(int(logits[0, -1].argmax()))
        window.append(out[-1])
        if len(window) > context:
            window = window[-(context // 2):]
    return out


@pytest.mark.parametrize("attn", ["mla-qknorm", "gqa"])
def test_generation_past_the_context_slides_the_window(attn):
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(attn=attn, block_size=8)).double().eval()
    with torch.no_grad():  # a sharper model, so that greedy paths depend on the context
        for p in model.parameters():
            p.mul_(4)
    prompts = [[1, 2, 3, 4, 5], [6, 7], list(range(1, 12))]  # the last is longer than the context
    unbounded_differs = False
    for p in prompts:
        got = generate(model, [p], 21, temperature=0)[0]
        assert got == greedy_sliding_without_cache(model, p, 21)
        seq = list(p)
        for _ in range(21):  # never sliding: positions past the context
            seq.append(int(model(torch.tensor([seq]), allow_longer=True)[0][0, -1].argmax()))
        unbounded_differs |= seq[len(p):] != got
    assert unbounded_differs, "the test model is too flat to tell sliding from not sliding"
    assert all(len(g) == 21 for g in generate(model, prompts, 21, temperature=0))
