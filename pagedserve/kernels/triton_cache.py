"""Triton kernel writing this step's K/V into paged cache slots.

The kernel addresses the cache through strides (block, offset in block, head), so one kernel
serves every backend layout: the reference's head-major `[2, heads, blocks, block_size, dim]`
and flash-attn's `[2, blocks, block_size, heads, dim]`. A negative slot is skipped: CUDA-graph
padding rows carry slot -1 so they never touch a real cache slot.

Set `TRITON_INTERPRET=1` before this module is imported to run it on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]  # times a head stride: may pass 2**31
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    dst = block * stride_cb + offset * stride_co + heads * stride_ch + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, key, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


def write_kv_cache_strided(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # one of the two halves of a layer's cache, any layout
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64; negative = skip
    block_size: int,
    cache_strides: tuple[int, int, int],  # (block, offset in block, head) in elements
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # The head dim is read and written as one contiguous vector.
    assert key.stride(2) == value.stride(2) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *cache_strides,
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """The reference's `write_kv_cache`, in the reference's layout."""
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    strides = (k_cache.stride(1), k_cache.stride(2), k_cache.stride(0))
    write_kv_cache_strided(key, value, k_cache, v_cache, slot_mapping, kv_cache.shape[3], strides)
