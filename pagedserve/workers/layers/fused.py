"""Which one-pass kernels a layer's input takes: `cpu_native`'s (C++, on the CPU) or
`cuda_layers`' (Triton, on CUDA). Both offer `rms_norm`, `rotary` and `silu_and_mul` with one
signature, so a layer asks once and calls the same name either way."""

from __future__ import annotations

from types import ModuleType

import torch

from pagedserve.kernels import cpu_native, cuda_layers


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """The kernel module that takes `x`, or None: the layer's own torch ops."""
    for kernels in (cpu_native, cuda_layers):
        if kernels.can_fuse(x):
            return kernels
    return None
