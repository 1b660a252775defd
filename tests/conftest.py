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
