"""The torch reference attention (the ground truth every other backend is tested against) checked
itself against the definition: dense causal attention written as einsums over each sequence's
whole K/V, read slot by slot out of the paged cache."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from tests.kernels.paged_batch import PagedBatch, make_batch


def dense_causal_attention(batch: PagedBatch) -> torch.Tensor:
    """softmax(q k^T * scale, causal) v per sequence, K/V heads shared by groups of query heads."""
    meta, cache = batch.meta, batch.kv_cache
    block_size = cache.shape[3]
    group = batch.query.shape[1] // cache.shape[1]
    out = torch.empty_like(batch.query)
    for i, seq_len in enumerate(meta.seq_lens_host):
        start, end = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
        blocks = [int(meta.block_tables[i, p // block_size]) for p in range(seq_len)]
        key = torch.stack([cache[0, :, b, p % block_size] for p, b in enumerate(blocks)])  # [seq, kv_heads, dim]
        value = torch.stack([cache[1, :, b, p % block_size] for p, b in enumerate(blocks)])
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        query = batch.query[start:end]
        scores = torch.einsum("qhd,khd->hqk", query.double(), key.double()) * batch.scale
        query_positions = torch.arange(seq_len - (end - start), seq_len).unsqueeze(1)
        scores.masked_fill_(torch.arange(seq_len).unsqueeze(0) > query_positions, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), value.double()).to(out.dtype)
    return out


@pytest.mark.parametrize(
    "query_lens, context_lens",
    [
        # Decodes (one past several of the reference's 64-token decode chunks), a prompt with no
        # context, and a chunk after cached context (chunked prefill or a prefix hit).
        ([1, 1, 1, 9, 7], [150, 70, 3, 0, 21]),
        ([1], [0]),  # a decode of a one-token sequence
        ([5, 17], [0, 16]),  # prefills only, one starting exactly at a block boundary
    ],
)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (4, 4)])
def test_reference_matches_dense_causal_attention(query_lens, context_lens, num_heads, num_kv_heads):
    batch = make_batch(query_lens, context_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=16, seed=len(query_lens))
    reference.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.meta.slot_mapping)
    got = reference.paged_attention(batch.query, batch.key, batch.value, batch.kv_cache, batch.meta, batch.scale)
    torch.testing.assert_close(got, dense_causal_attention(batch), rtol=1e-5, atol=1e-5)


def test_write_kv_cache_puts_each_token_in_its_slot():
    batch = make_batch([1, 6], [40, 5], num_heads=4, num_kv_heads=2, block_size=16)
    before = batch.kv_cache.clone()
    reference.write_kv_cache(batch.key, batch.value, batch.kv_cache, batch.meta.slot_mapping)
    block_size = batch.kv_cache.shape[3]
    written = set()
    for row, slot in enumerate(batch.meta.slot_mapping.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(batch.kv_cache[0, :, block, offset], batch.key[row])
        assert torch.equal(batch.kv_cache[1, :, block, offset], batch.value[row])
        written.add((block, offset))
    untouched = torch.ones(batch.kv_cache.shape[2], block_size, dtype=torch.bool)
    for block, offset in written:
        untouched[block, offset] = False
    assert torch.equal(batch.kv_cache[:, :, untouched], before[:, :, untouched])  # nothing else moved
