"""Pure-torch paged attention: the ground truth for every other backend, and the CPU path.

Cache layout, shared by all backends: `key_cache` and `value_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`; token slot s lives at
`cache.view(-1, num_kv_heads, head_dim)[s]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.metadata import AttentionMetadata

# Decode attention walks the block table this many blocks at a time, with an online softmax, so
# the gathered K/V chunk stays small enough for the CPU's caches at any batch size.
DECODE_BLOCKS_PER_CHUNK = 16


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


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


def _prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    key = key_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len]
    value = value_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len]
    query_len = query.shape[0]
    q, k, v = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    enable_gqa = q.shape[0] != k.shape[0]
    if query_len == seq_len:  # nothing cached before the chunk: plain causal attention
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
    else:
        # The chunk's queries sit at the end of the sequence: row j may see keys 0..offset+j.
        offset = seq_len - query_len
        rows = torch.arange(query_len, device=query.device).unsqueeze(1) + offset
        mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out.transpose(0, 1)


def _decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, all sequences at once, block chunk by block chunk."""
    nd = query.shape[0]
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    group = query.shape[1] // num_kv_heads
    q = (query.float() * scale).view(nd, num_kv_heads, group, head_dim)
    seq_lens = meta.seq_lens[:nd].long()
    max_blocks = (max(meta.seq_lens_host[:nd]) + block_size - 1) // block_size
    block_tables = meta.block_tables[:nd, :max_blocks].long()

    running_max = torch.full((nd, num_kv_heads, group, 1), float("-inf"), device=query.device)
    running_sum = torch.zeros_like(running_max)
    acc = torch.zeros(nd, num_kv_heads, group, head_dim, device=query.device)
    for first in range(0, max_blocks, DECODE_BLOCKS_PER_CHUNK):
        blocks = block_tables[:, first : first + DECODE_BLOCKS_PER_CHUNK]
        chunk_len = blocks.shape[1] * block_size
        # [nd, chunk_len, kv_heads, head_dim] -> [nd, kv_heads, head_dim, chunk_len]
        key = key_cache[blocks].view(nd, chunk_len, num_kv_heads, head_dim).permute(0, 2, 3, 1)
        value = value_cache[blocks].view(nd, chunk_len, num_kv_heads, head_dim).transpose(1, 2)
        scores = torch.matmul(q, key.float())  # [nd, kv_heads, group, chunk_len]
        positions = torch.arange(first * block_size, first * block_size + chunk_len, device=query.device)
        scores.masked_fill_((positions >= seq_lens.unsqueeze(1)).view(nd, 1, 1, -1), float("-inf"))
        chunk_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        # A chunk wholly past a sequence's end leaves its max at -inf: keep exp() finite there.
        safe_max = torch.where(torch.isinf(chunk_max), torch.zeros_like(chunk_max), chunk_max)
        correction = torch.exp(running_max - safe_max)
        weights = torch.exp(scores - safe_max)
        running_sum = running_sum * correction + weights.sum(dim=-1, keepdim=True)
        acc = acc * correction + torch.matmul(weights, value.float())
        running_max = chunk_max
    return (acc / running_sum).view(nd, num_kv_heads * group, head_dim).to(query.dtype)
