"""Without CUDA, the Triton kernels run in Triton's interpreter on CPU tensors. The interpreter is
chosen when a kernel is decorated (at import), so it is switched on here, before any test module
imports them. With CUDA the same tests run compiled on the GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# triton is in the test extra only where it has wheels (x86-64 Linux); elsewhere the modules that
# need it skip themselves, visibly, with the reason (pytest.importorskip at their top).

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
