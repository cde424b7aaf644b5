"""The fast CPU paged attention (`attention_backend="cpu"`, what `auto` picks on the CPU).

Same cache layout and signature as `reference.py`, which stays the plain ground truth it is tested
against. The difference is decode, the bulk of serving: the reference walks the block tables a
chunk at a time and upcasts each gathered chunk to float32 for an online softmax it writes out in
many small ops. Here each group of decode rows gathers its K/V once, in the cache's own dtype, and
one call of torch's fused CPU attention kernel (`scaled_dot_product_attention`, which accumulates
bf16 in float32 internally) does the rest:

- GQA without repeating K/V: a decode row's `group` query heads that share a KV head all sit at the
  same position and see the same keys, so they are that KV head's query of length `group`, with no
  causal mask between them. K/V stay `[rows, kv_heads, len, head_dim]`, exactly as gathered.
- Ragged lengths: rows arrive longest first; a group of rows is padded to its longest, and a
  boolean mask hides the padding. Groups are cut where the padding would waste more than a quarter
  of the gathered tokens, and where the gather would pass `DECODE_GROUP_BYTES`.

Prefill chunks go through the reference's per-sequence path (the fused kernel already).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.reference import kv_cache_shape, prefill_attention, write_kv_cache

__all__ = ["kv_cache_shape", "write_kv_cache", "paged_attention", "decode_row_groups", "gather_rows_kv"]

DECODE_GROUP_BYTES = 4 * 1024**2  # fresh pages for larger gathers cost more than the calls saved (measured)
# A group of rows may pad to its longest row as long as padding stays under this share of it.
MAX_PADDING_FRACTION = 0.25


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's, already in the cache
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its cached tokens."""
    nd = meta.num_decodes
    if nd and nd == meta.num_seqs:  # decode-only: no output buffer to copy through
        return _decode_attention(query, kv_cache, meta, scale)
    out = torch.empty_like(query)
    if nd:
        out[:nd] = _decode_attention(query[:nd], kv_cache, meta, scale)
    prefill_attention(query, key, value, kv_cache, meta, scale, out)  # the reference's: no faster path yet
    return out


def decode_row_groups(lens: list[int], block_size: int, bytes_per_token: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of the longest-first `lens`, each gathered and attended at once."""
    groups, start = [], 0
    while start < len(lens):
        longest_blocks = -(-lens[start] // block_size)
        padded_len = longest_blocks * block_size
        end = start + 1
        while end < len(lens):
            rows = end + 1 - start
            real = sum(lens[start : end + 1])
            if rows * padded_len * bytes_per_token > DECODE_GROUP_BYTES:
                break
            if rows * padded_len - real > MAX_PADDING_FRACTION * rows * padded_len:
                break
            end += 1
        groups.append((start, end))
        start = end
    return groups


def gather_rows_kv(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of each row's blocks, each `[rows, kv_heads, num_blocks * block_size,
    head_dim]` and contiguous (the fused kernel's layout), with one row gather from the cache."""
    _, heads, num_blocks, block_size, head_dim = kv_cache.shape
    rows, blocks_per_row = block_table.shape
    block_rows = kv_cache.view(2 * heads * num_blocks, block_size * head_dim)
    # Row of (k-or-v, head h, block b) is (kv * heads + h) * num_blocks + b; order [kv, row, head, block].
    offsets = torch.arange(2 * heads, device=block_table.device).view(2, 1, heads, 1) * num_blocks
    index = (offsets + block_table.long().view(1, rows, 1, blocks_per_row)).view(-1)
    kv = block_rows.index_select(0, index).view(2, rows, heads, blocks_per_row * block_size, head_dim)
    return kv[0], kv[1]


def _decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    nd, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    lens = meta.seq_lens_host[:nd]
    assert all(a >= b for a, b in zip(lens, lens[1:])), "decodes must be sorted longest first"
    # [rows, kv_heads, group, head_dim]: the group's query heads as one KV head's query rows.
    q = query.view(nd, num_kv_heads, group, head_dim).to(kv_cache.dtype)
    out = torch.empty_like(q)
    bytes_per_token = 2 * num_kv_heads * head_dim * kv_cache.element_size()
    for start, end in decode_row_groups(lens, block_size, bytes_per_token):
        rows = end - start
        num_blocks = -(-lens[start] // block_size)
        key, value = gather_rows_kv(kv_cache, meta.block_tables[start:end, :num_blocks])
        padded_len = num_blocks * block_size
        mask = None
        if lens[end - 1] < padded_len:  # some row ends before the padded length
            positions = torch.arange(padded_len, device=query.device)
            mask = (positions < meta.seq_lens[start:end].unsqueeze(1)).view(rows, 1, 1, padded_len)
        out[start:end] = F.scaled_dot_product_attention(q[start:end], key, value, attn_mask=mask, scale=scale)
    return out.view(nd, num_heads, head_dim).to(query.dtype)
