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


def check_float_state(state: dict, module: torch.nn.Module, source: str) -> None:
    """ValueError naming ``source`` if ``state`` gives a floating-point parameter or buffer of
    ``module`` a tensor that is not floating point: ``load_state_dict`` would cast integer
    weights silently, a model that runs and means nothing."""
    own = module.state_dict()
    bad = [(k, v.dtype) for k, v in state.items() if k in own and isinstance(v, torch.Tensor)
           and own[k].is_floating_point() and not (v.is_floating_point() or v.is_complex())]
    if bad:
        names = ", ".join(f"{k} ({dt})" for k, dt in bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise ValueError(f"{source}: holds integer weights where the model has floating-point ones: {names}; "
                         f"this is not a checkpoint of trained weights")
