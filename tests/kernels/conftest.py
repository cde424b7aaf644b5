"""Without CUDA, the Triton kernels run in Triton's interpreter on CPU tensors. The interpreter is
chosen when a kernel is decorated (at import), so it is switched on here, before any test module
imports them. With CUDA the same tests run compiled on the GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
