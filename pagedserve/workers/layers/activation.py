"""The gated activation of Llama-family MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.workers.layers.fused import fused_kernels


class SiluAndMul(nn.Module):
    """silu(gate) * up, where the input is [..., gate | up] from one merged projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = fused_kernels(x)
        if kernels is not None:  # one pass
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one activation-sized allocation, not two
