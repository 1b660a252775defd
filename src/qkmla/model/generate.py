"""Sampling through the decode caches: the latent cache for MLA variants, a KV cache otherwise.

Prompts of different lengths share one batch: they are right-padded, prefilled in one call
with ``input_lengths``, and each sequence then continues from its own last token.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .gpt import GPT


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of logits [B, V]; temperature 0 is greedy."""
    if temperature < 0:
        raise ValueError(f"temperature: expected a number >= 0, got {temperature!r}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k: expected a positive int or None, got {top_k!r}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: GPT, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> list[list[int]]:
    """Continue every prompt by ``max_new_tokens`` tokens; returns the new tokens per prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: expected one or more non-empty token lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected a positive int, got {max_new_tokens!r}")
    model.eval()
    device = model.wte.weight.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    B, T = len(prompts), int(lengths.max())
    idx = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        idx[b, :len(p)] = torch.as_tensor(list(p), device=device)
    caches = model.make_caches(B, T + max_new_tokens)
    logits, _ = model(idx, caches=caches, input_lengths=lengths)
    last = logits[torch.arange(B, device=device), lengths - 1]  # each prompt's own last token
    out = []
    for _ in range(max_new_tokens):
        nxt = sample_next(last, temperature, top_k, generator)
        out.append(nxt)
        logits, _ = model(nxt[:, None], caches=caches)
        last = logits[:, -1]
    return torch.stack(out, dim=1).tolist()
