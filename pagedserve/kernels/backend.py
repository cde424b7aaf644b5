"""Choosing an attention implementation: one signature per operation, several implementations.

`torch` is the reference (the plain ground truth); `native` the C++ CPU kernel of `cpu_native`
(built on first use; what `auto` picks on the CPU when it builds); `cpu` the pure-torch fast path
of `cpu_attention` (tested against the reference; `auto`'s CPU pick in half precision when the
native kernel cannot be built); `triton` the paged kernels of
`triton_attention` (on CUDA, or on the CPU under TRITON_INTERPRET=1 for tests); `flash_attn`
flash-attn's paged API where that package is installed. `auto` is Triton on CUDA; on the CPU,
native, or without a compiler cpu in half precision and the reference in float32.
The non-reference backends are imported only when chosen, so a CPU install never needs them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from pagedserve.kernels import cpu_attention, cpu_native, reference


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    # (num_blocks, block_size, num_kv_heads, head_dim) -> shape of one layer's K/V cache tensor
    kv_cache_shape: Callable[[int, int, int, int], tuple[int, ...]]
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., object]


TORCH = AttentionBackend("torch", reference.kv_cache_shape, reference.write_kv_cache, reference.paged_attention)
# The reference's cache layout and writer: only decode attention differs.
CPU = AttentionBackend("cpu", reference.kv_cache_shape, reference.write_kv_cache, cpu_attention.paged_attention)
NATIVE = AttentionBackend("native", reference.kv_cache_shape, cpu_native.write_kv_cache, cpu_native.paged_attention)
# Backends whose kernels read lengths from device tensors only, so a CUDA graph can capture them.
GRAPH_SAFE_BACKENDS = ("triton", "flash_attn")


def get_attention_backend(
    name: str, device: str, *, block_size: int | None = None, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """The backend called `name` for a `device` ("cpu" or "cuda"); `block_size` and `dtype`, when
    given, are checked against what the backend supports, so a bad pairing fails at start-up."""
    if name == "auto":
        if device == "cuda":
            name = "triton" if _triton_installed() else "torch"
        elif cpu_native.is_available():
            name = "native"
        else:
            # Measured (benchmarks/cpu_kernels.py): the fused path wins in half precision, where
            # the reference upcasts every K/V chunk; in float32 the reference's matmuls are faster.
            name = "cpu" if dtype in (torch.bfloat16, torch.float16) else "torch"
    if name == "torch":
        return TORCH
    if name == "cpu":
        if device != "cpu":
            raise ValueError("attention_backend='cpu' runs on the CPU only; on CUDA use 'auto', 'triton' or 'flash_attn'")
        return CPU
    if name == "native":
        if device != "cpu":
            raise ValueError("attention_backend='native' runs on the CPU only; on CUDA use 'auto', 'triton' or 'flash_attn'")
        if not cpu_native.is_available():
            raise ValueError(
                "attention_backend='native' could not build its C++ kernel (needs g++; the log says why); "
                "use 'auto' or 'cpu' on the CPU"
            )
        return NATIVE
    if name == "triton":
        return _triton_backend(device)
    if name == "flash_attn":
        return _flash_attn_backend(device, block_size, dtype)
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, torch, native, cpu, triton or flash_attn")


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_backend(device: str) -> AttentionBackend:
    if not _triton_installed():
        raise ValueError("attention_backend='triton' needs the triton package: pip install triton")
    from pagedserve.kernels import triton_attention, triton_cache

    if device == "cpu" and not triton_attention.IS_INTERPRETED:
        raise ValueError(
            "attention_backend='triton' runs on the CPU only under Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before starting (slow; meant for tests), "
            "or use attention_backend='torch' (or 'auto') on the CPU"
        )
    # The reference's cache layout: a cache written by one can be read by the other.
    return AttentionBackend(
        "triton", reference.kv_cache_shape, triton_cache.write_kv_cache, triton_attention.paged_attention
    )


def _flash_attn_backend(device: str, block_size: int | None, dtype: torch.dtype | None) -> AttentionBackend:
    from pagedserve.kernels import flash_attn

    flash_attn.check_supported(block_size, dtype, device)
    return AttentionBackend("flash_attn", flash_attn.kv_cache_shape, flash_attn.write_kv_cache, flash_attn.paged_attention)
