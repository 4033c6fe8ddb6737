import os

import torch

# Without a GPU, run the Triton kernels in Triton's CPU interpreter (must be set before triton.jit runs).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
