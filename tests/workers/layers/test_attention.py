"""workers/layers/attention.py: the layer reads the step's metadata from forward_context (and
fails clearly outside one), writes the step's K/V into its cache before attending, and before a
cache exists attends causally over the batch (the memory-profiling pass)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import get_attention_backend, reference
from pagedserve.workers.layers.attention import Attention, current_context, forward_context
from tests.kernels.paged_batch import make_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8


def layer() -> Attention:
    return Attention(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, get_attention_backend("torch", "cpu"), layer_index=0)


def flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


def test_outside_a_forward_context_it_says_so():
    q = torch.zeros(1, NUM_HEADS * HEAD_DIM)
    kv = torch.zeros(1, NUM_KV_HEADS * HEAD_DIM)
    with pytest.raises(RuntimeError, match=r"outside forward_context\(\)"):
        layer()(q, kv, kv)


def test_the_context_holds_for_the_block_only():
    attention = layer()
    with forward_context(None, {0: attention}):
        assert current_context().layers == {0: attention}
    with pytest.raises(RuntimeError):
        current_context()


def test_a_step_writes_its_kv_then_attends_over_the_paged_cache():
    batch = make_batch([1, 3], [5, 2], NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)  # a decode, then a chunk
    attention = layer()
    attention.kv_cache = batch.kv_cache.clone()
    with forward_context(batch.meta, {0: attention}):
        out = attention(flat(batch.query), flat(batch.key), flat(batch.value))
    expected_cache = batch.kv_cache.clone()
    reference.write_kv_cache(batch.key, batch.value, expected_cache, batch.meta.slot_mapping)
    assert torch.equal(attention.kv_cache, expected_cache)  # the step's K/V landed in its slots
    expected = reference.paged_attention(batch.query, batch.key, batch.value, expected_cache, batch.meta, batch.scale)
    assert out.shape == (4, NUM_HEADS * HEAD_DIM)
    torch.testing.assert_close(out, flat(expected))


def test_without_a_cache_the_batch_is_one_causal_sequence():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(5, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(5, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    with forward_context(None, {}):
        out = layer()(flat(q), flat(k), flat(v))
    # Each query head h reads KV head h // 2 (GQA), causally.
    k_full, v_full = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k_full) * HEAD_DIM**-0.5
    scores = scores.masked_fill(torch.triu(torch.ones(5, 5, dtype=torch.bool), 1), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", F.softmax(scores, dim=-1), v_full)
    torch.testing.assert_close(out, flat(expected), rtol=1e-5, atol=1e-5)
