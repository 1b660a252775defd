import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. Triton reads this
# when it is first imported, and other packages (transformers) may import it during
# collection, so it is set here, in the first conftest pytest loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
