"""Triton paged attention over a mixed batch (decodes, then prefill chunks) in one launch.

Grid: (query tiles, KV heads, KV splits). A query tile is up to BLOCK_Q query tokens of one
sequence times the GROUP query heads that share one KV head (GQA/MQA), so a KV tile loaded once
serves every head of the group. Tiles are numbered so that sequence i's tiles start at
`query_start_loc[i] // BLOCK_Q + i`: a program finds its sequence by binary search, and the grid
size depends only on the number of tokens and sequences, never on their lengths. That keeps the
launch free of host syncs and CUDA-graph safe (lengths are read from device tensors).

Each program walks its sequence's block table a KV tile (TILE_N tokens) at a time, gathering
every token's physical slot, so any page size works with tiles sized for `tl.dot`. Softmax is
online, in float32, base 2. With several KV splits (small decode batches, where one program per
(sequence, head) would leave most of a GPU idle) each split keeps its partial max, sum and
accumulator and a second kernel merges them.

Set `TRITON_INTERPRET=1` before this module is imported to run it on CPU tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.kernels.metadata import AttentionMetadata

# Whether these kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import).
IS_INTERPRETED = bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs") else (
    os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
)
LOG2_E = 1.4426950408889634
# Decode batches with fewer (sequence, KV head) pairs than this split each sequence's context
# across several programs, so a batch of 1 still fills the GPU's SMs.
SPLIT_KV_BELOW_PROGRAMS = 256
MAX_KV_SPLITS = 16


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first tile (query_start_loc[i] // BLOCK_Q + i) is <= tile."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_seqs stays a runtime value: specialised to the constant 1 it would change the loop
# variable's type in the binary search.
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch, stride_bt,
    num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)  # times a head stride, past 2**31 in large caches
    split = tl.program_id(2)
    seq = _find_sequence(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # first query of this tile, in the chunk
    if q_first >= q_len:
        return  # a spare tile: sequences get up to one more tile than they need
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # cached tokens before the chunk

    rows = tl.arange(0, BLOCK_M)
    q_local = q_first + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = context_len + q_local  # row r may see keys 0..q_pos[r]
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    token = (q_start + q_local).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys past the tile's last query position are masked for every row: skip them.
    kv_len = tl.minimum(seq_len, context_len + tl.minimum(q_first + BLOCK_Q, q_len))
    num_tiles = tl.cdiv(kv_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for kv_tile in range(tile_lo, tile_hi):
        n = kv_tile * TILE_N + tl.arange(0, TILE_N)
        n_ok = n < kv_len
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = block * stride_cb + (n % BLOCK_SIZE) * stride_co + kv_head * stride_ch
        kv_mask = n_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps max -inf: subtract 0 instead (no NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no visible key (graph padding): 0
        out_offsets = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split  # [num_tokens, num_heads, splits]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=out_mask)
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    stride_ot, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """One program per (token, head): rescale each split's partials to the common max, add."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    part = (token * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_max_ptr + part)
    l = tl.load(part_sum_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=dim_ok[None, :], other=0.0)
    m_all = tl.max(m, axis=0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    weight = tl.exp2(m - m_safe)  # an empty split has m = -inf: weight 0
    total = tl.sum(l * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    out_offsets = token * stride_ot + head * stride_oh + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # this step's K/V: already in the cache, so unused here
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_kv_heads, num_blocks, block_size, head_dim]
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """The reference's `paged_attention`, in the reference's cache layout. `num_splits` forces
    the KV split count (tests); by default it is chosen from the batch's shape."""
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    strides = (k_cache.stride(1), k_cache.stride(2), k_cache.stride(0))
    return paged_attention_strided(
        query, k_cache, v_cache, block_size, num_kv_heads, strides, meta, scale, num_splits
    )


def paged_attention_strided(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_size: int,
    num_kv_heads: int,
    cache_strides: tuple[int, int, int],  # (block, offset in block, head) in elements
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Uses only tensor shapes and `meta.max_query_len` on the host, so it can be captured in a
    CUDA graph; lengths and block ids are read on the device."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = meta.seq_lens.shape[0]
    group = num_heads // num_kv_heads
    assert group * num_kv_heads == num_heads and query.stride(2) == 1
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    is_decode_only = meta.max_query_len == 1
    block_m = max(16 if is_decode_only else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    block_d = triton.next_power_of_2(head_dim)
    if num_splits is None:
        num_splits = _choose_num_splits(query.device, is_decode_only, num_seqs * num_kv_heads)
    assert num_splits & (num_splits - 1) == 0, "the merge kernel reads splits as a power-of-two vector"
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    # Unsplit, the kernel never touches the partials: `out` stands in (no allocations per layer).
    parts = _partials(num_tokens, num_heads, head_dim, num_splits, query.device) if num_splits > 1 else (out, out, out)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, *parts,
        meta.block_tables, meta.seq_lens, meta.query_start_loc,
        num_seqs, scale * LOG2_E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *cache_strides, meta.block_tables.stride(0),
        num_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q,
        TILE_N=64 if block_d <= 128 else 32, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        # The interpreter's tl.dot misreads bfloat16 operands: it gets float32 copies.
        UPCAST=IS_INTERPRETED and query.dtype == torch.bfloat16,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            *parts, out, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        )
    return out


def _choose_num_splits(device: torch.device, is_decode_only: bool, num_programs: int) -> int:
    """Prefill tiles already give enough programs; a small decode batch splits its context. The
    CPU interpreter runs programs one after another, so there splits would only add work."""
    if device.type != "cuda" or not is_decode_only or num_programs >= SPLIT_KV_BELOW_PROGRAMS:
        return 1
    return min(MAX_KV_SPLITS, triton.next_power_of_2(SPLIT_KV_BELOW_PROGRAMS // num_programs))


def _partials(num_tokens: int, num_heads: int, head_dim: int, num_splits: int, device) -> tuple[torch.Tensor, ...]:
    """Per-split accumulators, maxima and sums, in float32."""
    rows = num_tokens * num_heads * num_splits
    acc = torch.empty(rows * head_dim, dtype=torch.float32, device=device)
    maxima = torch.empty(rows, dtype=torch.float32, device=device)
    sums = torch.empty(rows, dtype=torch.float32, device=device)
    return acc, maxima, sums

