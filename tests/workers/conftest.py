"""Triton's interpreter must be switched on (on a machine without CUDA) before any module imports
the Triton kernels, which test_cuda_graphs runs. In a full run tests/kernels/conftest.py does it
first; run alone, this directory's modules would import the kernels compiled-mode first."""

import tests.kernels.conftest  # noqa: F401  (sets TRITON_INTERPRET=1 without CUDA)
