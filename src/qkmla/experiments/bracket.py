"""Choosing a learning rate from a bracket of finished runs, the same way in every experiment
that tunes each variant at the horizon it reports: the lowest score wins, and a best rate at
an end of the bracket first asks for the next rate out on the experiment's grid of rates."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from .grid import FINISHED


def neighbour(lr: float, step: int, grid: Sequence[float]) -> Optional[float]:
    """The rate ``step`` places from ``lr`` on ``grid`` (ascending); None past either end."""
    i = min(range(len(grid)), key=lambda j: abs(math.log(grid[j] / lr))) + step
    return grid[i] if 0 <= i < len(grid) else None


def choose_rate(losses: dict[float, Optional[float]], extensions_left: int,
                grid: Sequence[float]) -> tuple[Optional[float], Optional[float]]:
    """(chosen rate, rate to add) from a bracket's scores (lower is better; None: not finished
    yet). At an end of the bracket the next rate out on ``grid`` is asked for first, while
    ``extensions_left`` allows it and the grid has one."""
    if not losses or any(v is None for v in losses.values()):
        return None, None
    best = min(losses, key=losses.get)
    rates = sorted(losses)
    if extensions_left > 0:
        step = -1 if best == rates[0] else 1 if best == rates[-1] and len(rates) > 1 else 0
        nxt = neighbour(best, step, grid) if step else None
        if nxt is not None and nxt not in losses:
            return None, nxt
    return best, None


def run_score(row: dict, key: str) -> Optional[float]:
    """What a bracket run is worth: its results row's ``key`` (lower is better); None until the
    run is finished, infinite when it ended non-finite (it loses to every finite score)."""
    if row.get("status") not in FINISHED:
        return None
    return row.get(key) if row["status"] == "done" else math.inf


def settle(first: Sequence[float], max_extensions: int, grid: Sequence[float],
           losses_of) -> tuple[list[float], Optional[float]]:
    """The rates of a bracket that starts at ``first``, with the extensions its scores have
    asked for so far, and its chosen rate (None until settled). ``losses_of(rates)`` scores
    the rates ({rate: loss}, None for a run not finished)."""
    rates = list(first)
    while True:
        chosen, extra = choose_rate(losses_of(rates), max_extensions - (len(rates) - len(first)), grid)
        if extra is None:
            return rates, chosen
        rates.append(extra)
