"""Without CUDA, the Triton kernels run in Triton's interpreter on CPU tensors. The interpreter is
chosen when a kernel is decorated (at import), so it is switched on here, before any test module
imports them. With CUDA the same tests run compiled on the GPU."""

from __future__ import annotations

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# triton is in the test extra only where it has wheels (x86-64 Linux); elsewhere skip what needs it.
if importlib.util.find_spec("triton") is None:
    collect_ignore = [
        "test_backend.py", "test_flash_attn_adapter.py",
        "test_triton_attention.py", "test_triton_compile.py", "test_triton_e2e.py",
    ]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
