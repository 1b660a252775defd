"""What the transformers integration's tests share: running a model step by step through its cache,
comparing logits, and moving a QK norm's weights away from their init.

Imported by the test modules beside it (``from .helpers import ...``); no tests here.
"""

from __future__ import annotations

import inspect

import torch
import transformers

# The cache argument's name: `past_key_values` until transformers 5.2x, `cache` since.
CACHE = "cache" if "cache" in inspect.signature(transformers.DeepseekV3ForCausalLM.forward).parameters \
    else "past_key_values"


def stepwise_logits(model, ids, steps: int, tokens=None, cache=None, **forward) -> tuple[list, torch.Tensor]:
    """Prefill ``ids`` [B, T] then ``steps`` single-token steps (greedy, or feeding ``tokens`` [B, steps]),
    through ``model`` with a cache (``cache``, or the one the model makes); returns every call's last
    logits ([B, vocab] each, steps + 1 of them) and the tokens fed [B, steps]."""
    logits, fed = [], []
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, **({CACHE: cache} if cache is not None else {}), **forward)
        cache = getattr(out, CACHE, None) or out.past_key_values
        logits.append(out.logits[:, -1])
        for i in range(steps):
            nxt = logits[-1].argmax(-1, keepdim=True) if tokens is None else tokens[:, i:i + 1]
            fed.append(nxt)
            out = model(input_ids=nxt, use_cache=True, **{CACHE: cache})
            logits.append(out.logits[:, -1])
    return logits, torch.cat(fed, dim=1)


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of ``a`` from ``b``, relative to ``b``'s largest magnitude."""
    return float((a - b).abs().max() / b.abs().max())


def away_from_ones(layers, scale: float) -> None:
    """Move the QK norms' weights of patched attention ``layers`` away from their init (ones) by
    ``scale`` times a standard normal, so a path that skipped them would differ."""
    with torch.no_grad():
        for layer in layers:
            for p in list(layer.q_norm.parameters()) + list(layer.k_norm.parameters()):
                p.add_(scale * torch.randn_like(p))
