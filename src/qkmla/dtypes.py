"""Dtype helpers shared by the attention arithmetic."""

from __future__ import annotations

import torch


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and logits are computed in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in ``dtype``, with the no-op case decided in Python.

    ``t.to(dtype)`` returns t itself when the dtype already matches, but still goes through
    the dispatcher; a decode step makes dozens of such calls on tiny tensors, and on a
    small CPU each costs microseconds.
    """
    return t if t.dtype == dtype else t.to(dtype)
