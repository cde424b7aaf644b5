"""Pure-torch paged attention: the ground truth for every other backend, and the CPU path.

Cache layout (`kv_cache_shape`): one tensor per layer, `[2, num_kv_heads, num_blocks,
block_size, head_dim]` (keys, then values), so token slot s of head h lives at
`kv_cache[0 or 1].view(num_kv_heads, -1, head_dim)[h, s]`. Head-major blocks make a gathered block
table already `[heads, tokens, head_dim]`-contiguous: attention reads it with batched matmuls and
no transposing copy. Gathers index the cache as rows of one block of one head (`block_rows`): a
dim-0 `index_select` of whole rows copies several times faster than indexing a middle dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.metadata import AttentionMetadata

# Decode attention gathers K/V in chunks of about this many tokens per sequence (an online softmax
# joins them) and at most this many bytes, so memory stays bounded at any batch size and context
# length, and a sequence wastes at most one partial chunk past its end.
DECODE_CHUNK_TOKENS = 64
DECODE_CHUNK_BYTES = 16 * 1024**2


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, num_kv_heads, num_blocks, block_size, head_dim)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    _, num_kv_heads, _, _, head_dim = kv_cache.shape
    kv_cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key.transpose(0, 1))
    kv_cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value.transpose(0, 1))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]: this step's, already in the cache
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its cached tokens."""
    out = torch.empty_like(query)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode_attention(query[:nd], kv_cache, meta, scale)
    prefill_attention(query, key, value, kv_cache, meta, scale, out)
    return out


def prefill_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
) -> None:
    """The prefill chunks' rows of `out` (the sequences after the decodes), one sequence at a time;
    shared by the backends that differ only in how they attend decodes."""
    qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
    for i in range(meta.num_decodes, meta.num_seqs):
        start, end = qsl[i], qsl[i + 1]
        if end - start == lens[i]:  # nothing cached before this chunk: its own K/V are all of it
            k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
        else:
            k, v = _cached_kv(kv_cache, meta.block_tables[i], lens[i])
        out[start:end] = _prefill_attention(query[start:end], k, v, scale)


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the given blocks, each [heads, len(block_ids) * block_size, head_dim],
    with one row gather (into `out`'s storage when given: reusing it saves fresh pages)."""
    _, heads, num_blocks, block_size, head_dim = kv_cache.shape
    block_rows = kv_cache.view(2 * heads * num_blocks, block_size * head_dim)
    # Row of (k-or-v, head h, block b) is ((kv * heads) + h) * num_blocks + b.
    offsets = torch.arange(2 * heads, device=block_ids.device).unsqueeze(1) * num_blocks
    index = (offsets + block_ids.unsqueeze(0)).view(-1)
    if out is None:
        rows = block_rows.index_select(0, index)
    else:
        rows = torch.index_select(block_rows, 0, index, out=out[: index.numel()])
    kv = rows.view(2, heads, -1, head_dim)
    return kv[0], kv[1]


def _cached_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = kv_cache.shape[3]
    key, value = gather_kv(kv_cache, block_table[: (seq_len + block_size - 1) // block_size].long())
    return key[:, :seq_len], value[:, :seq_len]


def _prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [num_kv_heads, seq_len, head_dim]
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The chunk's queries are the last `query_len` of the sequence's `seq_len` tokens."""
    query_len, num_heads, _ = query.shape
    num_kv_heads, seq_len, _ = key.shape
    # 4-D inputs with K/V repeated per query head take torch's fused CPU kernel; 3-D inputs or
    # enable_gqa fall back to a path several times slower.
    group = num_heads // num_kv_heads
    q = query.transpose(0, 1).unsqueeze(0)
    k = (key.repeat_interleave(group, dim=0) if group > 1 else key).unsqueeze(0)
    v = (value.repeat_interleave(group, dim=0) if group > 1 else value).unsqueeze(0)
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        # Row j sits at position offset + j and may see keys 0..offset+j.
        offset = seq_len - query_len
        rows = torch.arange(query_len, device=query.device).unsqueeze(1) + offset
        mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


def _decode_attention(
    query: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, all sequences at once, walking the block tables a chunk
    of blocks at a time with an online softmax. Decodes arrive longest first, so the sequences
    still running at a chunk are a prefix of the rows: shorter ones cost nothing past their end."""
    nd, num_heads, head_dim = query.shape
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    lens = meta.seq_lens_host[:nd]
    assert all(a >= b for a, b in zip(lens, lens[1:])), "decodes must be sorted longest first"
    # [kv_heads, nd, group, head_dim]: batched over (head, sequence) like the gathered K/V.
    q = (query.float() * scale).view(nd, num_kv_heads, group, head_dim).transpose(0, 1)
    seq_lens = meta.seq_lens[:nd].long().view(1, nd, 1, 1)
    max_blocks = (lens[0] + block_size - 1) // block_size
    block_tables = meta.block_tables[:nd, :max_blocks].long()
    block_bytes = 2 * num_kv_heads * block_size * head_dim * kv_cache.element_size()
    blocks_per_chunk = max(1, min(DECODE_CHUNK_TOKENS // block_size, DECODE_CHUNK_BYTES // (nd * block_bytes)))

    workspace = kv_cache.new_empty(2 * num_kv_heads * nd * blocks_per_chunk, block_size * head_dim)
    running_max = torch.full((num_kv_heads, nd, group, 1), float("-inf"), device=query.device)
    running_sum = torch.zeros_like(running_max)
    acc = torch.zeros(num_kv_heads, nd, group, head_dim, device=query.device)
    num_active = nd
    for first in range(0, max_blocks, blocks_per_chunk):
        start = first * block_size
        while lens[num_active - 1] <= start:  # rows whose context ended before this chunk
            num_active -= 1
        rows = slice(0, num_active)
        chunk = block_tables[rows, first : first + blocks_per_chunk]
        chunk_len = chunk.shape[1] * block_size
        key, value = gather_kv(kv_cache, chunk.reshape(-1), workspace)
        key = key.view(num_kv_heads, num_active, chunk_len, head_dim)
        value = value.view(num_kv_heads, num_active, chunk_len, head_dim)
        scores = torch.matmul(q[:, rows], key.float().transpose(-1, -2))  # [kv_heads, rows, group, chunk_len]
        positions = torch.arange(start, start + chunk_len, device=query.device)
        scores.masked_fill_(positions >= seq_lens[:, rows], float("-inf"))
        chunk_max = torch.maximum(running_max[:, rows], scores.amax(dim=-1, keepdim=True))
        correction = torch.exp(running_max[:, rows] - chunk_max)
        weights = torch.exp(scores - chunk_max)
        running_sum[:, rows] = running_sum[:, rows] * correction + weights.sum(dim=-1, keepdim=True)
        acc[:, rows] = acc[:, rows] * correction + torch.matmul(weights, value.float())
        running_max[:, rows] = chunk_max
    out = (acc / running_sum).transpose(0, 1).reshape(nd, num_heads, head_dim)
    return out.to(query.dtype)
