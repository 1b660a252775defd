import os

import torch

# Without a GPU, Triton kernels run in its interpreter on CPU tensors. This must be set
# before Triton compiles anything, so it is set when the kernel tests are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
