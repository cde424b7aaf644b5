"""The native CPU paged attention (`attention_backend="native"`, what `auto` picks on the CPU
when the C++ kernel builds): every query token, decode or prefill, reads its K/V straight from
the paged cache in C++ (`csrc/cpu_paged_attention.cpp`), with no gathered copy and no padding.
Measured against the pure-torch paths (`benchmarks/cpu_kernels.py`), it wins for decode batches
and for prefill chunks alike (up to 2,048-token chunks).

Same cache layout and signature as `reference.py`, the ground truth it is tested against.
"""

from __future__ import annotations

import torch

from pagedserve.kernels import native_build
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.reference import kv_cache_shape, write_kv_cache

__all__ = ["kv_cache_shape", "write_kv_cache", "paged_attention", "is_available"]


def is_available() -> bool:
    """True once the C++ kernel is built and loaded (built on first use; see native_build)."""
    return native_build.load()


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's, already in the cache
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its cached tokens."""
    query = query.contiguous()
    out = torch.empty_like(query)
    torch.ops.pagedserve_cpu.paged_attention(
        query, out, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0, meta.num_seqs, scale
    )
    return out
