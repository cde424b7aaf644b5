"""The layers' fused path on CUDA: one Triton kernel each for RMSNorm, the rotary embedding and
SiLU-and-mul (`triton_layers`). Importable without triton, which only GPU installs carry; the
layers keep their torch path where it is missing."""

from __future__ import annotations

import importlib.util

import torch

_HAS_TRITON = importlib.util.find_spec("triton") is not None


def can_fuse(x: torch.Tensor) -> bool:
    """Whether the fused kernels take `x`: a CUDA tensor, triton installed, and not under
    torch.compile (inductor fuses those layers itself)."""
    return x.device.type == "cuda" and _HAS_TRITON and not torch.compiler.is_compiling()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from pagedserve.kernels import triton_layers

    return triton_layers.rms_norm(x, weight, eps)


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from pagedserve.kernels import triton_layers

    return triton_layers.rotary(x, positions, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from pagedserve.kernels import triton_layers

    return triton_layers.silu_and_mul(x)
