import os
import signal

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads this
# when it is first imported, and other packages (transformers) may import it during
# collection, so it is set here, in the first conftest pytest loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A shell starts a background job (`pytest ... &`, nohup) with SIGINT ignored, and Python then keeps
# it ignored: the fault table's Ctrl-C rows would test nothing. They test what a user's terminal
# gives, Python's own handler, here and in the commands they start.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _cores():
    """The cores this process may run on (a cpuset or taskset, as in CI containers; every core
    where the platform cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# pytest-xdist (addopts: -n auto) runs one worker per core; each worker's torch then gets its share
# of the cores, so that two workers' matrix products do not each spread over both cores and wait on
# one another. A single process (-n 0) keeps torch's own default.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, _cores() // _WORKERS))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a machine without it (the GPU image) runs -n 0
def pytest_xdist_auto_num_workers(config):
    """-n auto: one worker per core this process may run on, not per core the machine has."""
    return _cores()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def refused(capsys):
    """refused(argv, pattern): ``qkmla argv`` refuses with exit status 2 and one stderr line
    ``qkmla COMMAND: ...`` matching ``pattern`` (a regex), and no traceback."""
    import re

    from qkmla.cli import main

    def run(argv, pattern):
        capsys.readouterr()
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"qkmla {argv[0]}: ") and "Traceback" not in err, err
        assert re.search(pattern, err), err
        return err
    return run
