"""The attention layer: write this step's K/V into the paged cache, then attend over it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.backend = backend
        # This layer's keys and values in the backend's layout, bound by the model runner once
        # the cache is sized.
        self.kv_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.kv_cache is None:
            return self._profile_attention(q, k, v)
        # Every K/V of the step is written before any query reads: a request may hit prefix-cache
        # blocks that another request of the same step is filling.
        self.backend.write_kv_cache(k, v, self.kv_cache, meta.slot_mapping)
        out = self.backend.paged_attention(q, k, v, self.kv_cache, meta, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)

    def _profile_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Before the cache exists (memory profiling): the whole batch as one causal sequence."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=self.scale, enable_gqa=True
        )
        return out.transpose(0, 1).reshape(-1, self.num_heads * self.head_dim)
