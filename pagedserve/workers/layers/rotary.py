"""Rotary position embeddings (rotate-half layout) with the default, linear and llama3 scalings.

The inverse frequencies and the cos/sin values are computed with the same float32 operations as
Hugging Face transformers, so positions embed bit-for-bit alike. On the CPU the rotation itself is
one fused pass (kernels/cpu_native), rounding once instead of after each op; on CUDA one Triton
kernel (kernels/cuda_layers) that rounds the same way; both in every dtype.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.workers.layers.fused import fused_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: Any) -> dict:
    """transformers 5 puts everything in `rope_parameters`; older configs use `rope_theta` and
    `rope_scaling`. Accept both."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling type {params['rope_type']!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return params


def inverse_frequencies(head_dim: int, params: dict) -> torch.Tensor:
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if params["rope_type"] == "linear":
        inv_freq /= params["factor"]
    elif params["rope_type"] == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: low frequencies slowed by `factor`, high ones kept, a smooth ramp between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, params: dict):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, params)
        freqs = torch.arange(max_positions, dtype=torch.int64).float().unsqueeze(1) * inv_freq
        # Buffers, not parameters: they are derived, never loaded from the checkpoint.
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """query: [num_tokens, num_heads, head_dim]; key: [num_tokens, num_kv_heads, head_dim]."""
        kernels = fused_kernels(query)
        if kernels is not None and query.stride(2) == 1 and key.stride(2) == 1:  # one pass each
            return kernels.rotary(query, positions, self.cos, self.sin), kernels.rotary(key, positions, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1).to(query.dtype)
        sin = self.sin[positions].unsqueeze(1).to(query.dtype)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
