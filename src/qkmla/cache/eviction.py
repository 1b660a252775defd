"""Eviction policies: which cached tokens each sequence of a latent cache keeps.

A policy is a small, stateless description (one object may serve every layer's cache). A
cache built with ``LatentCache(..., policy=...)`` runs it (``evictor.Eviction``) after the
prefill and every ``interval`` decode steps. Every policy keeps, per sequence,

    keep = first ``sinks`` slots  ∪  last ``window`` slots  ∪  the best-scored of the rest,

k tokens in all, and the policies differ in the score of a token in the middle:

    StreamingLLM   recency: the newest tokens win (Xiao et al., attention sinks + window)
    H2O            attention received, accumulated over every query since the token was
                   cached (Zhang et al., heavy hitters)
    SnapKV         attention received from an observation window (the last ``window``
                   prompt tokens), pooled over neighbouring slots (Li et al.)

Budget: ``budget`` tokens per sequence, or ``kept_fraction`` f of the tokens the sequence has
seen (cached or evicted): k = max(ceil(f * seen), sinks + window, 1). f = 1 keeps everything.

Scores come from the logits the layer really uses (``scores.attention_received``: latent
query, latent + RoPE key, key scalars, softmax scale). One latent is shared by every head of
a layer, so a policy keeps ONE set of tokens per sequence and layer, and per-head scores are
combined by ``head_reduce``:

* ``"mean"`` (default): the attention mass the token receives from all heads together. It
  ranks as the sum does, so it is H2O's accumulated attention summed over heads and kvpress's
  choice for heads that share a KV head; it tracks the total output perturbation of evicting
  the token.
* ``"max"``: the token's best head. It protects a token only one head needs (a retrieval
  head's needle), which the mean dilutes h-fold.

Kept tokens keep their RoPE positions (the cache's ``keep``): their stored keys stay valid.
StreamingLLM's ``reposition=True`` re-rotates the kept RoPE keys to contiguous positions
instead, so positions never outgrow the budget.
"""

from __future__ import annotations

import inspect
import math
from fractions import Fraction
from typing import Optional

import torch
import torch.nn.functional as F

from ..utils.checked import Frozen, as_int, as_number, check_bool, is_finite_number, is_int
from .base import WriteSlot

HEAD_REDUCTIONS = ("mean", "max")
POOLINGS = ("avg", "max")


def _check_int(name: str, value, low: int, why: str = "") -> None:
    if not is_int(value) or value < low:
        raise ValueError(f"{name}: expected an int >= {low}{why}, got {value!r}")
    if value >= 2**63:  # torch holds token counts in int64: 2**70 failed at the first eviction (OverflowError)
        raise ValueError(f"{name}: expected an int below 2**63 (token counts are int64), got {value!r}")


def _check_choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")


def _fit(scores: torch.Tensor, S: int) -> torch.Tensor:
    """Per-slot scores [B, h, S'] cut or zero-padded to S slots."""
    return F.pad(scores, (0, S - scores.shape[-1])) if scores.shape[-1] < S else scores[..., :S]


class EvictionPolicy(Frozen):
    """What every policy shares: the budget, the protected sinks and window, the schedule.

    Args:
        budget: tokens kept per sequence (an int), or None with ``kept_fraction``.
        kept_fraction: fraction in (0, 1] of the tokens each sequence has seen, or None with ``budget``.
        window: the last ``window`` slots of a sequence are always kept.
        sinks: the first ``sinks`` slots of a sequence are always kept.
        interval: evict every ``interval`` decode steps (and after every prefill); None: after
            prefills only.
        head_reduce: how per-head scores become one score per token: "mean" or "max".

    A forward that writes more than one token per sequence is a prefill, one that writes a
    single token a decode step (a chunked prefill evicts after each chunk).

    Raises:
        ValueError naming the argument, at construction, before any work.

    A policy is fixed once made (:class:`~qkmla.utils.checked.Frozen`): ``pol.budget = 0`` raises
    AttributeError instead of running with a budget the constructor refuses.
    """

    name = "policy"
    keeps_scores = False  # whether accumulated scores survive an eviction (H2O) or restart (SnapKV)
    reposition = False

    def __init__(self, *, budget: Optional[int] = None, kept_fraction: Optional[float] = None, window: int = 0,
                 sinks: int = 0, interval: Optional[int] = 1, head_reduce: str = "mean"):
        # A NumPy number is a count or a fraction, as for the caches: np.int64(4) was refused as "expected an int
        # >= 0, got np.int64(4)", and np.float32(0.5) as "expected a number in (0, 1], got np.float32(0.5)".
        budget, window, sinks, interval = (as_int(v) for v in (budget, window, sinks, interval))
        kept_fraction = as_number(kept_fraction)  # np.int64(1) is the fraction 1, as the int 1 is (review 15)
        _check_int("window", window, 0)
        _check_int("sinks", sinks, 0)
        if (budget is None) == (kept_fraction is None):
            raise ValueError(f"budget, kept_fraction: give exactly one (a token count or a fraction in (0, 1]), "
                             f"got budget={budget!r}, kept_fraction={kept_fraction!r}")
        if budget is not None:
            _check_int("budget", budget, max(1, sinks + window), f" (sinks + window = {sinks} + {window}, at least 1)")
            self.fraction = None
        else:
            if not is_finite_number(kept_fraction) or not 0 < kept_fraction <= 1:
                raise ValueError(f"kept_fraction: expected a number in (0, 1], got {kept_fraction!r}")
            # ceil(0.1 * 30) is 3, not 4; a fraction too small for the denominator stays above 0
            self.fraction = max(Fraction(kept_fraction).limit_denominator(1 << 20), Fraction(1, 1 << 20))
        if interval is not None:
            _check_int("interval", interval, 1, " (decode steps between evictions) or None (after prefills only)")
        _check_choice("head_reduce", head_reduce, HEAD_REDUCTIONS)
        self.budget, self.kept_fraction, self.window, self.sinks = budget, kept_fraction, window, sinks
        self.interval, self.head_reduce = interval, head_reduce

    # -- what is observed --------------------------------------------------------------------

    def observed(self, slot: WriteSlot, prefill: bool) -> Optional[torch.Tensor]:
        """[B, T] bool: the new tokens whose attention this policy records; None: none."""
        return None

    def accumulate(self, scores: Optional[torch.Tensor], attention: torch.Tensor) -> torch.Tensor:
        """Per-head scores [B, h, S'] so far plus ``attention`` [B, h, S] received now (S >= S')."""
        return attention if scores is None else _fit(scores, attention.shape[-1]) + attention

    def compacted(self, scores: Optional[torch.Tensor], order: torch.Tensor,
                  seqlens: torch.Tensor) -> Optional[torch.Tensor]:
        """The scores after ``cache.keep`` moved slot order[b, i] to slot i, [B, h, max(seqlens)]."""
        if scores is None or not self.keeps_scores:
            return None
        S = int(seqlens.max())
        scores = _fit(scores, order.shape[1])
        moved = scores.gather(2, order[:, None, :S].expand(-1, scores.shape[1], -1))
        return moved.masked_fill(torch.arange(S, device=moved.device) >= seqlens[:, None, None], 0)

    # -- what is kept ------------------------------------------------------------------------

    def targets(self, seen: torch.Tensor) -> torch.Tensor:
        """[B] tokens to keep per sequence, from the tokens each has seen [B]."""
        if self.fraction is None:
            return torch.full_like(seen, self.budget)
        f = self.fraction
        # At least one token, as a budget is: a fraction of a few tokens is never "keep none".
        return ((seen * f.numerator + f.denominator - 1) // f.denominator).clamp_min(max(1, self.sinks + self.window))

    def token_scores(self, scores: Optional[torch.Tensor], seqlens: torch.Tensor) -> torch.Tensor:
        """[B, max(seqlens)] one score per token, higher kept first; ``scores`` [B, h, S] or None."""
        raise NotImplementedError

    def combine_heads(self, scores: torch.Tensor) -> torch.Tensor:
        """[B, h, S] -> [B, S] by ``head_reduce`` (module docstring)."""
        return scores.mean(dim=1) if self.head_reduce == "mean" else scores.amax(dim=1)

    def keep_mask(self, scores: Optional[torch.Tensor], seqlens: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """[B, max(seqlens)] bool, the slots each sequence keeps: its sinks, its window, and the
        best-scored of the rest up to its target (ties: the earlier slot)."""
        S = int(seqlens.max())
        slots = torch.arange(S, device=seqlens.device)
        protected = (slots < self.sinks) | (slots >= (seqlens - self.window)[:, None])
        score = self.token_scores(scores, seqlens)
        score = score.masked_fill(protected, math.inf).masked_fill(slots >= seqlens[:, None], -math.inf)
        rank = score.argsort(dim=1, descending=True, stable=True)
        kept = slots < torch.minimum(self.targets(seen), seqlens)[:, None]  # the first k ranks
        return torch.zeros_like(kept).scatter(1, rank, kept)

    def __repr__(self) -> str:
        size = f"budget={self.budget}" if self.budget is not None else f"kept_fraction={self.kept_fraction}"
        return (f"{type(self).__name__}({size}, sinks={self.sinks}, window={self.window}, "
                f"interval={self.interval}, head_reduce={self.head_reduce!r}{', reposition=True' * self.reposition})")


class StreamingLLM(EvictionPolicy):
    """Attention sinks plus the most recent tokens (Xiao et al., 2023).

    Keeps the first ``sinks`` tokens and the newest k - sinks (the newest one always, so
    ``budget`` must exceed ``sinks``); reads no attention.
    ``reposition=True`` (the paper's choice) re-rotates the kept RoPE keys to positions
    0..k-1 after each eviction, and new tokens continue from k; by default kept tokens keep
    their original positions.

    Examples:
        >>> StreamingLLM(sinks=4, budget=1024)    # 4 sinks + the 1020 newest tokens
        StreamingLLM(budget=1024, sinks=4, window=1, interval=1, head_reduce='mean')
    """

    name = "streaming-llm"

    def __init__(self, sinks: int = 4, *, budget: Optional[int] = None, kept_fraction: Optional[float] = None,
                 interval: Optional[int] = 1, reposition: bool = False):
        check_bool("reposition", reposition)
        super().__init__(budget=budget, kept_fraction=kept_fraction, window=1, sinks=sinks, interval=interval)
        self.reposition = reposition

    def token_scores(self, scores, seqlens):
        S = int(seqlens.max())
        return torch.arange(S, dtype=torch.float32, device=seqlens.device).expand(len(seqlens), S)


class H2O(EvictionPolicy):
    """Heavy hitters by accumulated attention plus a recent window (Zhang et al., 2023).

    Every real query's attention to each cached token is added up, per head, from the
    prefill on; the scores move with their tokens when the cache compacts. A token's
    score is its accumulated attention combined over heads (``head_reduce``).
    """

    name = "h2o"
    keeps_scores = True

    def __init__(self, *, budget: Optional[int] = None, kept_fraction: Optional[float] = None, window: int = 32,
                 sinks: int = 0, interval: Optional[int] = 1, head_reduce: str = "mean"):
        super().__init__(budget=budget, kept_fraction=kept_fraction, window=window, sinks=sinks,
                         interval=interval, head_reduce=head_reduce)

    def observed(self, slot, prefill):
        return slot.valid if slot.valid is not None else torch.ones_like(slot.slots, dtype=torch.bool)

    def token_scores(self, scores, seqlens):
        S = int(seqlens.max())
        if scores is None:
            return torch.zeros(len(seqlens), S, device=seqlens.device)
        return self.combine_heads(_fit(scores, S))


class SnapKV(EvictionPolicy):
    """Prompt compression by an observation window's attention, pooled (Li et al., 2024).

    The last ``window`` real tokens of a prefill observe the cache; their attention to each
    earlier token, summed over the window, is pooled over ``kernel_size`` neighbouring slots
    per head (``pooling`` "avg" or "max", as SnapKV's reference code), combined over heads,
    and the best tokens are kept with the window itself. ``interval`` None (the default, the
    paper's) compresses prompts only; with an interval, the decode queries since the last
    eviction are the observation window.
    """

    name = "snapkv"

    def __init__(self, *, budget: Optional[int] = None, kept_fraction: Optional[float] = None, window: int = 32,
                 sinks: int = 0, interval: Optional[int] = None, head_reduce: str = "mean", kernel_size: int = 5,
                 pooling: str = "avg"):
        window, kernel_size = as_int(window), as_int(kernel_size)  # a NumPy int is a count (EvictionPolicy)
        _check_int("window", window, 1, " (the observation window)")
        _check_int("kernel_size", kernel_size, 1)
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size: expected an odd int (a window centred on each slot), got {kernel_size}")
        _check_choice("pooling", pooling, POOLINGS)
        super().__init__(budget=budget, kept_fraction=kept_fraction, window=window, sinks=sinks,
                         interval=interval, head_reduce=head_reduce)
        self.kernel_size, self.pooling = kernel_size, pooling

    def observed(self, slot, prefill):
        valid = slot.valid if slot.valid is not None else torch.ones_like(slot.slots, dtype=torch.bool)
        if not prefill:
            return valid if self.interval is not None else None
        written = (slot.seqlens - slot.slots[:, 0])[:, None]  # real tokens of this forward, [B, 1]
        return valid & (torch.arange(slot.slots.shape[1], device=written.device) >= written - self.window)

    def token_scores(self, scores, seqlens):
        S = int(seqlens.max())
        if scores is None:
            return torch.zeros(len(seqlens), S, device=seqlens.device)
        # Only the slots before the window are pooled (the window is kept anyway): as SnapKV,
        # which pools the prefix alone, zero-padded at both ends.
        prefix = torch.arange(S, device=seqlens.device) < (seqlens - self.window)[:, None]
        scores = _fit(scores, S) * prefix[:, None]
        pad = self.kernel_size // 2
        if self.pooling == "avg":
            pooled = F.avg_pool1d(scores, self.kernel_size, stride=1, padding=pad)
        else:
            pooled = F.max_pool1d(scores, self.kernel_size, stride=1, padding=pad)
        return self.combine_heads(pooled)


POLICIES = {cls.name: cls for cls in (StreamingLLM, H2O, SnapKV)}


def check_kept_fraction(policy: EvictionPolicy, seen: int, option=lambda name: name) -> None:
    """A ``kept_fraction`` that no cache of a generation could be held to, the most tokens a cache
    holds when it evicts being ``seen`` (every policy keeps its sinks and window whatever the
    fraction), is refused, not run as a policy that evicts nothing. Shared by ``qkmla generate``'s
    run and ``--hf`` paths (the latter ran it without a word); ``option`` names the arguments."""
    if policy.kept_fraction is None:
        return
    floor = policy.sinks + policy.window
    if math.ceil(policy.kept_fraction * seen) < floor:
        when = "when it evicts (after each prefill)" if policy.interval is None else "in this run"
        knobs = option("sinks") if policy.name == "streaming-llm" else \
            option("window") + (f" or {option('sinks')}" if policy.sinks else "")
        fix = f"raise {option('kept_fraction')} to at least {floor / seen:.3g}" if floor < seen else \
            "no fraction can evict anything here"
        raise ValueError(f"{option('kept_fraction')}: {policy.kept_fraction:g} of the at most {seen} "
                         f"token{'s' * (seen != 1)} a cache holds {when} is {math.ceil(policy.kept_fraction * seen)}, "
                         f"fewer than the sinks + window = {policy.sinks} + {policy.window} that {policy.name} always "
                         f"keeps; lower {knobs} ({fix})")


def make_policy(name: str, **kwargs) -> EvictionPolicy:
    """A policy by name (``POLICIES``: "streaming-llm", "h2o", "snapkv") and its arguments."""
    # A name that is no str is refused as an unknown one is: make_policy(["h2o"]) failed in the dict's lookup with
    # "TypeError: unhashable type: 'list'" (as mla_preset's did)
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"policy: expected one of {tuple(POLICIES)}, got {name!r:.80}")
    try:
        inspect.signature(POLICIES[name]).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"policy {name!r}: {e}") from None
    return POLICIES[name](**kwargs)
