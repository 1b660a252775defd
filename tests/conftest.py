import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads this
# when it is first imported, and other packages (transformers) may import it during
# collection, so it is set here, in the first conftest pytest loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class _OpNames(TorchDispatchMode):
    """Records the name of every aten op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def ops_of():
    """ops_of(fn) -> the aten op names (e.g. "bmm", "addmm") fn dispatches, in order."""
    def run(fn) -> list[str]:
        with _OpNames() as names:
            fn()
        return names.ops
    return run


@pytest.fixture
def threads():
    """threads(n) sets the intra-op thread count for the test; restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


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
