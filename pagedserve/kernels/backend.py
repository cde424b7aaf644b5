"""Choosing an attention implementation: one signature per operation, several implementations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pagedserve.kernels import reference


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # (num_blocks, block_size, num_kv_heads, head_dim) -> shape of one layer's K/V cache tensor
    kv_cache_shape: Callable[[int, int, int, int], tuple[int, ...]]
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., object]


TORCH = AttentionBackend("torch", reference.kv_cache_shape, reference.write_kv_cache, reference.paged_attention)


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """`auto` is the torch reference on the CPU (and, until GPU kernels land, on CUDA too)."""
    if name in ("auto", "torch"):
        return TORCH
    raise ValueError(
        f"attention_backend={name!r} is not available in this build; use 'auto' or 'torch'"
    )
