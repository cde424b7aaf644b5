"""Adapter for flash-attn's paged API (the optional `gpu` extra: `pip install flash-attn`).

Its own cache layout, `[2, num_blocks, block_size, num_kv_heads, head_dim]`, is the one
flash-attn's `block_table` argument reads. K/V are written by the Triton slot writer (which skips
the -1 slots of CUDA-graph padding). Decode-only steps call `flash_attn_with_kvcache`, which reads
lengths from `cache_seqlens` on the device and so can be captured in a CUDA graph; other steps call
`flash_attn_varlen_func(..., block_table=...)`, whose causal mask is aligned to the end of each
sequence (query j of a chunk sits at seq_len - query_len + j), as the reference's is.

Upstream flash-attn 2 accepts a paged cache only when the page size is a multiple of 256
("Paged KV cache block size must be divisible by 256"), and only float16 / bfloat16.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from pagedserve.kernels.metadata import AttentionMetadata

PAGE_SIZE_MULTIPLE = 256
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def is_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def check_supported(block_size: int | None, dtype: torch.dtype | None, device: str) -> None:
    """Raise a ValueError that says what to change when flash-attn cannot run this config."""
    if not is_installed():
        raise ValueError(
            "attention_backend='flash_attn' needs the flash-attn package, which is not installed: "
            "pip install 'pagedserve[gpu]' (CUDA only), or use attention_backend='triton' or 'auto'"
        )
    if device != "cuda":
        raise ValueError("attention_backend='flash_attn' runs only on CUDA devices; use 'torch' on the CPU")
    if block_size is not None and block_size % PAGE_SIZE_MULTIPLE:
        raise ValueError(
            f"attention_backend='flash_attn' needs block_size to be a multiple of {PAGE_SIZE_MULTIPLE} "
            f"(flash-attn's paged KV cache constraint), got {block_size}; set block_size=256 "
            "or use attention_backend='triton'"
        )
    if dtype is not None and dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"attention_backend='flash_attn' supports float16 and bfloat16, not {dtype}; "
            "set dtype='bfloat16' or use attention_backend='triton'"
        )


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"flash-attn supports head_dim up to {MAX_HEAD_DIM}, got {head_dim}")
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 = padding, skipped
) -> None:
    from pagedserve.kernels.triton_cache import write_kv_cache_strided

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    write_kv_cache_strided(key, value, k_cache, v_cache, slot_mapping, kv_cache.shape[2], strides)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # this step's K/V: already in the cache, so unused here
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if meta.max_query_len == 1:
        out = flash_attn_with_kvcache(
            query.unsqueeze(1), k_cache, v_cache,
            cache_seqlens=meta.seq_lens, block_table=meta.block_tables, softmax_scale=scale, causal=True,
        )
        return out.squeeze(1)
    cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens, 0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(
        query, k_cache, v_cache,
        cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale, causal=True, block_table=meta.block_tables,
    )
