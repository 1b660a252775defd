"""Sampling through the decode caches: the latent cache for MLA variants, a KV cache otherwise.

Prompts of different lengths share one batch: they are right-padded, prefilled in one call
with ``input_lengths``, and each sequence then continues from its own last token.

The model never saw positions past its ``block_size``, so generation slides a window: when
a sequence fills the context, its cache is emptied and given its last ``block_size // 2``
tokens (positions from 0 again), while the other sequences of the batch decode their next token
in the same forward, so a sequence continues as it would alone. Under an eviction policy every
sequence's last ``block_size // 2`` tokens are prefilled into fresh caches instead (a policy
chooses what to keep at each prefill, and its caches cannot drop tokens). A slide is one forward
of the whole batch (padded to ``block_size // 2`` tokens), so a batch whose sequences fill the
context at different steps pays it once per sequence, where sliding every sequence at the first
one's paid it once. A prompt longer than the context keeps its last ``block_size - 1`` tokens.

An eviction ``policy`` (MLA variants) bounds every layer's cache, and ``kv_format`` stores
its latents quantized (``qkmla.kv_formats``); the two compose. Kept tokens keep their
positions, so the window still slides at ``block_size`` positions, unless the policy
re-positions them (``StreamingLLM(reposition=True)``): then positions stay within its budget
and generation never slides.
"""

from __future__ import annotations

import collections
import numbers
from typing import Callable, Optional, Sequence

import torch

from ..utils.checked import as_int, as_number, check_bool, is_finite_number, is_int
from ..utils.limits import check_fits
from .gpt import GPT


def check_sampling(max_new_tokens, temperature, top_k, names=("max_new_tokens", "temperature", "top_k")) -> tuple:
    """The sampling arguments' ranges (``names``: how the caller spells them); returns them as Python numbers
    (max_new_tokens, temperature, top_k). A NumPy number is the number it holds: np.int64(3) was refused as
    "max_new_tokens: expected a positive int, got np.int64(3)" (np.float32 temperatures and top_k likewise)."""
    max_new_tokens, top_k = as_int(max_new_tokens), as_int(top_k)
    temperature = as_number(temperature)
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"{names[0]}: expected a positive int, got {max_new_tokens!r}")
    # temperature=True was a number to isinstance (1.0): a switch passed in the wrong place sampled
    if not is_finite_number(temperature) or temperature < 0:
        raise ValueError(f"{names[1]}: expected a finite number >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"{names[2]}: expected a positive int or None, got {top_k!r}")
    return max_new_tokens, temperature, top_k


def check_outlets(report, on_token) -> None:
    """``report`` is a dict (or None) and ``on_token`` a callable (or None), checked before any token: a
    report="junk" failed in report.update after every token was generated (the tokens lost with the
    AttributeError), and on_token=5 in the first step ("'int' object is not callable")."""
    if report is not None and not isinstance(report, dict):
        raise ValueError(f"report: expected a dict to fill (kept, seen) or None, got {type(report).__name__}")
    if on_token is not None and not callable(on_token):
        raise ValueError(f"on_token: expected a callable taking each step's token ids, or None, got "
                         f"{type(on_token).__name__}")


def check_prompts(prompts, vocab_size: int) -> None:
    """One or more non-empty lists of token ids, each an int in [0, vocab_size): a float id is
    refused, not truncated to another token."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__") or not len(prompts) \
            or any(isinstance(p, (str, bytes)) or not hasattr(p, "__len__") or not len(p) for p in prompts):
        raise ValueError("prompts: expected one or more non-empty lists of token ids")
    for i, p in enumerate(prompts):
        ids = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompts: prompt {i} holds {bad[0]!r}; token ids are ints in [0, {vocab_size})")


def check_generator(generator) -> None:
    """None or a torch.Generator: generator=5 (a seed where the generator belongs) failed in torch.multinomial
    after the prefill ("argument 'generator' must be torch.Generator, not int")."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator: expected a torch.Generator (torch.Generator().manual_seed(seed)) or None, "
                         f"got {generator!r:.80}")


def check_weights(model: GPT) -> None:
    """A ValueError naming ``model`` when its weights are on the meta device: a model built under
    ``torch.device("meta")`` (shapes only) failed in the prefill with "Tensor.item() cannot be called on meta
    tensors", naming nothing. A token is drawn from the logits' values, which such a model does not have."""
    if model.wte.weight.is_meta:
        raise ValueError("model: its weights are on the meta device (shapes only, e.g. built under "
                         "torch.device('meta') and never loaded), so it has no logits to draw tokens from; "
                         "model.to_empty(device='cpu') and load its weights first")


def check_logits(logits) -> None:
    """A ValueError naming ``logits`` unless it is a floating-point [B, V] tensor whose every row has a finite
    largest value: a NaN was taken by the greedy argmax as the best token, without a word, and failed in
    torch.multinomial when sampling ("probability tensor contains either inf, nan or element < 0"), as a row of
    -inf did; a 1-D tensor failed in the top-k cut ("too many indices")."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point() \
            or logits.shape[1] == 0:
        got = f"{logits.dtype} {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else f"{logits!r:.80}"
        raise ValueError(f"logits: expected a floating-point tensor [batch, vocab], got {got}")
    if logits.is_meta:  # failed reading the rows' values below, "Tensor.item() cannot be called on meta tensors"
        raise ValueError("logits: on the meta device (shapes only), so no token can be drawn from them; a model built "
                         "under torch.device('meta') needs its weights loaded first")
    bad = ~torch.isfinite(logits.amax(dim=-1)) | torch.isnan(logits).any(dim=-1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"logits: row {row} holds NaN or no finite value (a model whose output is not finite: "
                         f"{logits[row, :4].tolist()} ...), so no token can be drawn from it")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of logits [B, V]; temperature 0 is greedy."""
    _, temperature, top_k = check_sampling(1, temperature, top_k)
    check_generator(generator)
    check_logits(logits)
    if temperature == 0:
        return logits.argmax(dim=-1)
    # Shifted by the max first, so that a tiny temperature gives -inf, never inf - inf = NaN.
    logits = (logits.double() - logits.double().amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


def _forward_ragged(model: GPT, windows: list[list[int]], caches: list) -> torch.Tensor:
    """Append ``windows`` (one list of tokens per sequence, right-padded) to ``caches``; each window's
    last logits [B, V]."""
    device = model.wte.weight.device
    lengths = torch.tensor([len(w) for w in windows], device=device)
    idx = torch.zeros(len(windows), int(lengths.max()), dtype=torch.long, device=device)
    for b, w in enumerate(windows):
        idx[b, :len(w)] = torch.as_tensor(w, device=device)
    logits, _ = model(idx, caches=caches, input_lengths=lengths)
    return logits[torch.arange(len(windows), device=device), lengths - 1]


def _prefill(model: GPT, windows: list[list[int]], capacity: int, policy=None,
             kv_format: str = "dense") -> tuple[list, torch.Tensor]:
    """Fresh caches holding ``windows`` (right-padded); returns them and each window's last logits."""
    caches = model.make_caches(len(windows), capacity, policy=policy, kv_format=kv_format)
    return caches, _forward_ragged(model, windows, caches)


def max_tokens_seen(model: GPT, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                    prefills_only: bool = False) -> int:
    """The most tokens one sequence's cache has seen when :func:`generate` lets a policy evict
    (without a policy that re-positions): its prompt (at most block_size - 1 tokens) and the
    new tokens, until the window slides at block_size. ``prefills_only``: a policy that evicts
    after prefills only (SnapKV's default): the prompt, or the block_size // 2 tokens
    prefilled again when the window slides."""
    # As generate checks them: no prompts failed in max() ("arg is an empty sequence"), and max_new_tokens=-3 was
    # counted as -3 tokens seen
    check_prompts(prompts, model.config.vocab_size)
    max_new_tokens = check_sampling(max_new_tokens, 1.0, None)[0]
    check_bool("prefills_only", prefills_only)  # "no" is truthy: counted as prefills only, a smaller answer
    context = model.config.block_size
    longest = max(min(len(p), max(1, context - 1)) for p in prompts)
    if not prefills_only:
        return min(context, longest + max_new_tokens)
    slides = longest + max_new_tokens > context
    return max(longest, max(1, context // 2) if slides else 0)


@torch.no_grad()
def generate(model: GPT, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
             progress: bool = False, policy=None, kv_format: str = "dense",
             report: Optional[dict] = None, on_token: Optional[Callable[[list], None]] = None) -> list[list[int]]:
    """Continue every prompt by ``max_new_tokens`` tokens, sliding the context window (module
    docstring); returns the new tokens per prompt. ``progress`` shows a bar (on a terminal);
    ``policy`` is an eviction policy for the latent caches (``qkmla.cache.eviction``) and
    ``kv_format`` their latents' storage (``qkmla.kv_formats.KV_FORMATS``), MLA variants only.
    ``report``: a dict to fill with what the first layer's caches hold at the end, per
    sequence: ``kept`` (tokens cached) and ``seen`` (tokens written since the last slide,
    evicted ones included), so a caller can say what a policy really kept. ``on_token``: called
    with each step's new token ids (one per prompt), e.g. to print them as they come."""
    check_weights(model)
    check_prompts(prompts, model.config.vocab_size)
    max_new_tokens, temperature, top_k = check_sampling(max_new_tokens, temperature, top_k)
    check_outlets(report, on_token)
    check_generator(generator)
    check_bool("progress", progress)  # "no" is truthy: a bar was shown
    check_fits("max_new_tokens", 8 * len(prompts) * max_new_tokens, f"{max_new_tokens} new token ids for each of "
               f"{len(prompts)} prompt(s)")
    # In eval mode while it runs (no dropout), and handed back in the mode it came in: a model in training mode
    # was left in eval mode, and a training loop that sampled between steps trained on without dropout
    training = model.training
    model.eval()
    try:
        return _generate(model, prompts, max_new_tokens, temperature, top_k, generator, progress, policy, kv_format,
                         report, on_token)
    finally:
        model.train(training)


def _generate(model: GPT, prompts, max_new_tokens: int, temperature: float, top_k: Optional[int], generator,
              progress: bool, policy, kv_format: str, report: Optional[dict], on_token) -> list[list[int]]:
    """:func:`generate` after its checks, with the model in eval mode."""
    context = model.config.block_size
    # Only the last block_size tokens are ever prefilled again, so that is all the history
    # kept: memory grows with the output alone (8 bytes a token), however long the run.
    history = [collections.deque(list(p)[-(context - 1):] if context > 1 else list(p)[-1:], maxlen=context)
               for p in prompts]
    caches, last = _prefill(model, [list(h) for h in history], context, policy, kv_format)
    out = torch.empty(len(prompts), max_new_tokens, dtype=torch.long)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=max_new_tokens, desc="generate", unit="tok", disable=None, leave=False)
    for i in range(max_new_tokens):
        nxt = sample_next(last, temperature, top_k, generator)
        out[:, i] = nxt.cpu()
        ids = nxt.tolist()
        for h, t in zip(history, ids):
            h.append(t)
        if on_token is not None:
            on_token(ids)
        used = caches[0].next_positions.tolist()
        if max(used) == context and policy is None:
            # Only the sequences that filled the context slide: their caches are emptied and given their last
            # block_size // 2 tokens at positions from 0, while the others take their new token, in one ragged
            # forward; what a sequence sees never depends on the others in its batch (the whole batch slid,
            # cutting every shorter sequence's context in half).
            keep = max(1, context // 2)
            full = torch.tensor([n == context for n in used], device=caches[0].seqlens.device)
            for cache in caches:
                cache.drop_last(torch.where(full, cache.seqlens, torch.zeros_like(cache.seqlens)))
            windows = [list(h)[-keep:] if n == context else [t] for h, n, t in zip(history, used, ids)]
            last = _forward_ragged(model, windows, caches)
        elif max(used) == context:  # under an eviction policy, which chooses at each prefill: the whole batch
            keep = max(1, context // 2)
            caches, last = _prefill(model, [list(h)[-keep:] for h in history], context, policy, kv_format)
        else:
            logits, _ = model(nxt[:, None], caches=caches)
            last = logits[:, -1]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if report is not None:
        cache = caches[0]
        evicted = cache.eviction.evicted if cache.eviction is not None else torch.zeros_like(cache.seqlens)
        report.update(kept=cache.seqlens.tolist(), seen=(cache.seqlens + evicted).tolist())
    return out.tolist()
