"""The gated activation of Llama-family MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import cpu_native, cuda_layers


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is [..., gate | up] from one merged projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_native.can_fuse(x):  # one pass (bf16/fp16 on the CPU)
            return cpu_native.silu_and_mul(x)
        if cuda_layers.can_fuse(x):  # one kernel (CUDA)
            return cuda_layers.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one activation-sized allocation, not two
