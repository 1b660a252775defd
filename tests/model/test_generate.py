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
    # in one batch each sequence slides when it fills the context, and continues as it would alone (the
    # whole batch slid when the first one filled it, cutting the context of the others)
    batched = generate(model, prompts, 21, temperature=0)
    assert batched == [greedy_sliding_without_cache(model, p, 21) for p in prompts]


def greedy_streaming_without_cache(model, prompt, n, sinks, budget):
    """StreamingLLM with re-positioning spelled out with full forwards: every step the model
    sees the sinks and the newest tokens, budget + 1 in all, at positions 0, 1, ..."""
    seq, out = list(prompt), []
    for _ in range(n):
        window = seq if len(seq) <= budget + 1 else seq[:sinks] + seq[-(budget + 1 - sinks):]
        out.append(int(model(torch.tensor([window]))[0][0, -1].argmax()))
        seq.append(out[-1])
    return out


def test_generation_with_streaming_llm_repositioning_never_slides():
    """One layer (so a cached row depends on its token and position only): StreamingLLM(2 sinks,
    budget 5, re-positioned) keeps generating past block_size = 8 without sliding, and equals
    the model run on the sinks + the newest tokens at positions 0..5; evicting changes the text."""
    from qkmla.cache import StreamingLLM

    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(attn="mla-qknorm", block_size=8, n_layer=1)).double().eval()
    with torch.no_grad():  # a sharper model, so that greedy paths depend on the context
        for p in model.parameters():
            p.mul_(4)
    policy = StreamingLLM(sinks=2, budget=5, reposition=True)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9]]
    got = generate(model, prompts, 20, temperature=0, policy=policy)
    for p, g in zip(prompts, got):
        assert g == greedy_streaming_without_cache(model, p, 20, sinks=2, budget=5)
    assert got != generate(model, prompts, 20, temperature=0)


@pytest.mark.parametrize("attn", ["mla-qknorm", "mla"])
def test_generation_with_a_policy_that_keeps_everything_is_unchanged(attn):
    from qkmla.cache import H2O, SnapKV

    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(attn=attn, block_size=12)).double().eval()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8], [9, 10, 11]]
    want = generate(model, prompts, 16, temperature=0)  # slides past 12 positions
    assert generate(model, prompts, 16, temperature=0, policy=H2O(kept_fraction=1.0, window=1)) == want
    assert generate(model, prompts, 16, temperature=0, policy=SnapKV(kept_fraction=1.0, window=2)) == want
    evicting = generate(model, prompts, 16, temperature=0, policy=H2O(budget=4, window=2))
    assert [len(g) for g in evicting] == [16, 16, 16]


def test_a_policy_needs_an_mla_model():
    from qkmla.cache import H2O

    model = GPT(GPT_PRESETS["debug"].replace(attn="gqa"))
    with pytest.raises(ValueError, match="policy: eviction runs on latent caches, so on MLA variants only"):
        generate(model, [[1, 2]], 2, policy=H2O(budget=4, window=1))
    with pytest.raises(ValueError, match="policy: expected an EvictionPolicy"):
        GPT(GPT_PRESETS["debug"]).make_caches(1, 8, policy="h2o")


@pytest.mark.parametrize("prompts,message", [
    ([[1.7, 2.0]], r"prompts: prompt 0 holds 1.7; token ids are ints in \[0, 65\)"),
    ([[1, 2], [3, 65]], r"prompts: prompt 1 holds 65"),
    ([[-1]], r"prompts: prompt 0 holds -1"),
    ([[True, 2]], r"prompts: prompt 0 holds True"),
    ([torch.tensor([1.0, 2.0])], r"prompts: prompt 0 holds 1.0"),
    ([[]], "prompts: expected one or more non-empty lists"),
    ("abc", "prompts: expected one or more non-empty lists"),
])
def test_token_ids_are_what_they_claim_to_be(prompts, message):
    """Issue 27, class 3: a float id is refused, not truncated to another token; so is one
    outside the vocabulary (an index error deep in the embedding before)."""
    model = GPT(GPT_PRESETS["debug"])
    with pytest.raises(ValueError, match=message):
        generate(model, prompts, 2)


def test_the_model_refuses_ids_outside_its_vocabulary():
    model = GPT(GPT_PRESETS["debug"])
    with pytest.raises(ValueError, match=r"idx: token ids must lie in \[0, vocab_size=65\), got 0..65"):
        model(torch.tensor([[0, 65]]))


def test_generation_reports_what_a_policy_kept():
    from qkmla.cache import H2O

    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"].replace(block_size=16)).eval()
    report = {}
    generate(model, [[1, 2, 3], [4]], 10, temperature=0, policy=H2O(kept_fraction=0.5, window=2), report=report)
    assert report["seen"] == [13, 11] and report["kept"] == [7, 6]


def test_integer_ids_of_any_integer_type_are_accepted():
    import numpy as np

    torch.manual_seed(0)
    model = GPT(GPT_PRESETS["debug"]).eval()
    want = generate(model, [[1, 2, 3]], 3, temperature=0)
    assert generate(model, [np.array([1, 2, 3])], 3, temperature=0) == want
    assert generate(model, [[np.int64(1), np.int32(2), 3]], 3, temperature=0) == want
    assert generate(model, [torch.tensor([1, 2, 3])], 3, temperature=0) == want
