"""Pure-torch paged attention: the ground truth for every other backend, and the CPU path.

Cache layout (`kv_cache_shape`): `key_cache` and `value_cache` are each
`[num_kv_heads, num_blocks, block_size, head_dim]`, so token slot s of head h lives at
`cache.view(num_kv_heads, -1, head_dim)[h, s]`. Head-major blocks make a gathered block table
already `[heads, tokens, head_dim]`-contiguous: attention reads it with batched matmuls and no
transposing copy, which on a CPU costs as much as the gather itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.metadata import AttentionMetadata

# Decode attention gathers K/V for all sequences this many bytes at a time (an online softmax
# joins the chunks), so memory stays bounded at any batch size and context length.
DECODE_CHUNK_BYTES = 16 * 1024**2


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (num_kv_heads, num_blocks, block_size, head_dim)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    num_kv_heads, _, _, head_dim = key_cache.shape
    key_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    value_cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its cached tokens."""
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode_attention(query[:nd], key_cache, value_cache, meta, scale)
    qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
    for i in range(nd, meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        out[start:end] = _prefill_attention(
            query[start:end], key_cache, value_cache, meta.block_tables[i], lens[i], scale
        )
    return out


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[heads, len(block_ids) * block_size, head_dim] from a head-major cache."""
    heads, num_blocks, block_size, head_dim = cache.shape
    rows = cache.view(heads, num_blocks, block_size * head_dim).index_select(1, block_ids)
    return rows.view(heads, -1, head_dim)


def _prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    block_size = key_cache.shape[2]
    blocks = block_table[: (seq_len + block_size - 1) // block_size].long()
    key = gather_blocks(key_cache, blocks)[:, :seq_len]
    value = gather_blocks(value_cache, blocks)[:, :seq_len]
    query_len = query.shape[0]
    q = query.transpose(0, 1)
    enable_gqa = q.shape[0] != key.shape[0]
    if query_len == seq_len:  # nothing cached before the chunk: plain causal attention
        out = F.scaled_dot_product_attention(q, key, value, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    else:
        # The chunk's queries sit at the end of the sequence: row j may see keys 0..offset+j.
        offset = seq_len - query_len
        rows = torch.arange(query_len, device=query.device).unsqueeze(1) + offset
        mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= rows
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out.transpose(0, 1)


def _decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, all sequences at once, in chunks of blocks joined by an
    online softmax."""
    nd, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = key_cache.shape
    group = num_heads // num_kv_heads
    # [kv_heads, nd, group, head_dim]: batched over (head, sequence) like the gathered K/V.
    q = (query.float() * scale).view(nd, num_kv_heads, group, head_dim).transpose(0, 1)
    seq_lens = meta.seq_lens[:nd].long()
    max_blocks = (max(meta.seq_lens_host[:nd]) + block_size - 1) // block_size
    block_tables = meta.block_tables[:nd, :max_blocks].long()
    block_bytes = num_kv_heads * block_size * head_dim * key_cache.element_size()
    blocks_per_chunk = max(1, DECODE_CHUNK_BYTES // (nd * block_bytes))

    running_max = torch.full((num_kv_heads, nd, group, 1), float("-inf"), device=query.device)
    running_sum = torch.zeros_like(running_max)
    acc = torch.zeros(num_kv_heads, nd, group, head_dim, device=query.device)
    for first in range(0, max_blocks, blocks_per_chunk):
        chunk = block_tables[:, first : first + blocks_per_chunk]
        chunk_len = chunk.shape[1] * block_size
        key = gather_blocks(key_cache, chunk.reshape(-1)).view(num_kv_heads, nd, chunk_len, head_dim)
        value = gather_blocks(value_cache, chunk.reshape(-1)).view(num_kv_heads, nd, chunk_len, head_dim)
        scores = torch.matmul(q, key.float().transpose(-1, -2))  # [kv_heads, nd, group, chunk_len]
        positions = torch.arange(first * block_size, first * block_size + chunk_len, device=query.device)
        scores.masked_fill_((positions >= seq_lens.unsqueeze(1)).view(1, nd, 1, -1), float("-inf"))
        chunk_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        # A chunk wholly past a sequence's end leaves its max at -inf: keep exp() finite there.
        safe_max = chunk_max.masked_fill(torch.isinf(chunk_max), 0.0)
        correction = torch.exp(running_max - safe_max)
        weights = torch.exp(scores - safe_max)
        running_sum = running_sum * correction + weights.sum(dim=-1, keepdim=True)
        acc = acc * correction + torch.matmul(weights, value.float())
        running_max = chunk_max
    out = (acc / running_sum).transpose(0, 1).reshape(nd, num_heads, head_dim)
    return out.to(query.dtype)
