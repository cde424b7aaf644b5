"""RMSNorm computed exactly as Hugging Face does (in float32, cast back before the weight); on the
CPU the same rounding in one fused pass (kernels/cpu_native), and on CUDA in one Triton kernel
(kernels/cuda_layers)."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.workers.layers.fused import fused_kernels
from pagedserve.workers.layers.linear import default_weight_loader, new_parameter


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size, loader=default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = fused_kernels(x)
        if kernels is not None:  # one pass instead of seven ops
            return kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
