"""What a training step keeps for its backward, measured on the model before the first step.

A size check from the config alone (``trainer.check_sizes``) has to leave out what depends on
the kernels torch picks: whether attention stores its probabilities (SDPA's math path does, a
flash path does not), the RoPE and norm intermediates each variant saves. Those dominate a
large model's step: ``qkmla demo --preset paper-400m`` passed the config's bound on a 24 GiB
machine and was then killed by the kernel at 22 GiB. Here the forward runs for real on one
window and on a few, and every tensor autograd saves is counted (by storage, so views and
tensors saved twice count once; parameters not at all), which gives the step's bytes for any
number of windows without running it. Everything counted is alive at once at the end of the
forward, so the count is a lower bound of the step's peak above the weights already made.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["saved_bytes", "step_saved_bytes"]


def interruptible(work: Callable[[], None]) -> None:
    """``work()``, run in a thread of its own while this (main) thread waits, so that a signal's handler runs
    (a Ctrl-C, SIGTERM's unwinding) as the signal comes: Python runs handlers between bytecodes of the main
    thread, and one forward of a long window is a single torch call (--block-size 100000: over a minute deaf to
    SIGTERM, 11 minutes before SIGKILL). The work left behind on a signal is a daemon thread, ended with the
    process. Elsewhere than the main thread (no handler runs there anyway), ``work()`` runs in place."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        work()
        return
    failed: list[BaseException] = []
    done = threading.Event()  # what utils.command reads to tell work left running at a signal

    def run() -> None:
        try:
            work()
        except BaseException as e:  # handed to the waiting thread, which raises it
            failed.append(e)
        finally:
            done.set()

    worker = threading.Thread(target=run, name="qkmla-step-memory", daemon=True)
    worker.qkmla_done = done
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if failed:
        raise failed[0]


def saved_bytes(model: torch.nn.Module, windows: int, block_size: int) -> int:
    """Bytes autograd saves for a training forward of ``windows`` windows of ``block_size``
    tokens (token id 0 throughout: the sizes do not depend on the ids of a dense model), the
    parameters' storage excluded. Runs in train mode (the mode a step runs in; the model's own is
    put back) with the RNG state put back, so the run that follows draws exactly what it would
    have (dropout masks included). Everything it saved is freed when it returns."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held: list[torch.Tensor] = []  # alive until the count is taken, so no address is reused within it

    def pack(t: torch.Tensor) -> None:
        # Kept here, not in the graph: a graph node holding its own output is a reference cycle
        # through C++ that Python's collector cannot break, so the forward's tensors would outlive
        # the count (and the memory it measures would be gone from the run that follows).
        held.append(t)

    device = next(model.parameters()).device
    x = torch.zeros(windows, block_size, dtype=torch.long, device=device)
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda _: None)  # never unpacked: no backward
    was_training = model.training
    model.train()
    def forward() -> None:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad(), hooks:
            model(x, x)

    try:
        interruptible(forward)
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held
                    if t.device.type != "meta" and t.untyped_storage().data_ptr() not in params}.values())
    finally:
        held.clear()
        model.train(was_training)


def step_saved_bytes(model: torch.nn.Module, batch: int, block_size: int,
                     check: Optional[Callable[[int], None]] = None) -> int:
    """:func:`saved_bytes` of a step of ``batch`` windows, measured on at most three: from two
    windows on the bytes grow by the same amount per window (bytes(B) = fixed + B * per_window,
    the fixed part being tables made from the weights), so forwards of two and three windows give
    any batch. One window is no guide: a batch of one lets some ops broadcast where a larger
    batch copies (v4's sinks did), so its bytes extrapolated would overstate every other batch.
    ``check`` (a refusal, say) is called on the two windows' bytes before three are measured: a
    step of at least two windows saves at least that much, and the third is not run for nothing."""
    if batch <= 2:
        return saved_bytes(model, batch, block_size)
    two = saved_bytes(model, 2, block_size)
    if check is not None:
        check(two)
    per_window = max(saved_bytes(model, 3, block_size) - two, 0)
    return max(two - 2 * per_window, 0) + batch * per_window
