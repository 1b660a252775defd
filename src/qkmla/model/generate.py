"""Sampling through the decode caches: the latent cache for MLA variants, a KV cache otherwise.

Prompts of different lengths share one batch: they are right-padded, prefilled in one call
with ``input_lengths``, and each sequence then continues from its own last token.

The model never saw positions past its ``block_size``, so generation slides a window: when
a sequence fills the context, every sequence's last ``block_size // 2`` tokens are
prefilled into fresh caches (positions from 0 again) and decoding goes on from there. A
prompt longer than the context keeps its last ``block_size - 1`` tokens.

An eviction ``policy`` (MLA variants) bounds every layer's cache, and ``kv_format`` stores
its latents quantized (``qkmla.kv_formats``); the two compose. Kept tokens keep their
positions, so the window still slides at ``block_size`` positions, unless the policy
re-positions them (``StreamingLLM(reposition=True)``): then positions stay within its budget
and generation never slides.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from .gpt import GPT


def check_sampling(max_new_tokens, temperature, top_k, names=("max_new_tokens", "temperature", "top_k")) -> None:
    """The sampling arguments' ranges (``names``: how the caller spells them)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"{names[0]}: expected a positive int, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{names[1]}: expected a finite number >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{names[2]}: expected a positive int or None, got {top_k!r}")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of logits [B, V]; temperature 0 is greedy."""
    check_sampling(1, temperature, top_k)
    if temperature == 0:
        return logits.argmax(dim=-1)
    # Shifted by the max first, so that a tiny temperature gives -inf, never inf - inf = NaN.
    logits = (logits.double() - logits.double().amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


def _prefill(model: GPT, windows: list[list[int]], capacity: int, policy=None,
             kv_format: str = "dense") -> tuple[list, torch.Tensor]:
    """Fresh caches holding ``windows`` (right-padded); returns them and each window's last logits."""
    device = model.wte.weight.device
    lengths = torch.tensor([len(w) for w in windows], device=device)
    idx = torch.zeros(len(windows), int(lengths.max()), dtype=torch.long, device=device)
    for b, w in enumerate(windows):
        idx[b, :len(w)] = torch.as_tensor(w, device=device)
    caches = model.make_caches(len(windows), capacity, policy=policy, kv_format=kv_format)
    logits, _ = model(idx, caches=caches, input_lengths=lengths)
    return caches, logits[torch.arange(len(windows), device=device), lengths - 1]


@torch.no_grad()
def generate(model: GPT, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
             progress: bool = False, policy=None, kv_format: str = "dense") -> list[list[int]]:
    """Continue every prompt by ``max_new_tokens`` tokens, sliding the context window (module
    docstring); returns the new tokens per prompt. ``progress`` shows a bar (on a terminal);
    ``policy`` is an eviction policy for the latent caches (``qkmla.cache.eviction``) and
    ``kv_format`` their latents' storage (``qkmla.kv_formats.KV_FORMATS``), MLA variants only."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: expected one or more non-empty token lists")
    check_sampling(max_new_tokens, temperature, top_k)
    model.eval()
    context = model.config.block_size
    history = [list(p)[-(context - 1):] if context > 1 else list(p)[-1:] for p in prompts]
    caches, last = _prefill(model, history, context, policy, kv_format)
    out = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=max_new_tokens, desc="generate", unit="tok", disable=None, leave=False)
    for _ in range(max_new_tokens):
        nxt = sample_next(last, temperature, top_k, generator)
        out.append(nxt)
        for h, t in zip(history, nxt.tolist()):
            h.append(t)
        if int(caches[0].next_positions.max()) == context:  # the positions are used up: slide
            keep = max(1, context // 2)
            caches, last = _prefill(model, [h[-keep:] for h in history], context, policy, kv_format)
        else:
            logits, _ = model(nxt[:, None], caches=caches)
            last = logits[:, -1]
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return torch.stack(out, dim=1).tolist()
