"""torchrun's rendezvous, waited for where a signal can still reach the command.

``dist.init_process_group`` waits in C++ (the TCP store) for every rank to join, up to
``--dist-timeout`` (600 s by default). Python runs a signal handler only between bytecodes of the
main thread, so while the main thread itself waited there, SIGTERM and Ctrl-C did nothing: a rank
started with ranks that never come (variables left from another job, a peer that died first) sat
out the whole timeout, deaf to ``kill``. Here the wait runs in a helper thread and the main thread
joins it in short slices, so the command's own handlers (``utils.command.run_command``: SIGTERM
ends in one line, exit 143; Ctrl-C in "interrupted", 130) run at once. Nothing has been written by
then; the abandoned waiter is a daemon thread, gone with the process. A caller that goes on in
the same process after the interrupt (``qkmla.train.train`` in a notebook) keeps that waiter until
``--dist-timeout``: it may still meet a late peer and make the default process group, so start a
new process (restart the kernel) before training again.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

POLL_SECONDS = 0.2  # how long a signal may wait for the main thread to notice it


def init_process_group(**kwargs) -> None:
    """``dist.init_process_group(**kwargs)``, its errors raised here, interruptible by signals."""
    failure: list = []

    def wait() -> None:
        try:
            dist.init_process_group(**kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            failure.append(e)

    waiter = threading.Thread(target=wait, name="qkmla-rendezvous", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(POLL_SECONDS)  # returns to Python between slices: a pending signal's handler runs
    if failure:
        raise failure[0]
