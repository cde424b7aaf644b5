"""workers/layers/embedding.py: the vocabulary split across tensor-parallel ranks, padded when it
does not divide, with lookups summed across ranks and logits gathered to the first and cut back
to the vocabulary. The ranks run in turn in this process (fake_parallel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.workers.parallel_state import ParallelContext
from tests.workers.layers.fake_parallel import ranks

VOCAB, HIDDEN = 11, 4  # 11 does not divide by 2: the last rank holds one zero padding row
TABLE = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0))


def loaded(layer_class, parallel):
    layer = layer_class(VOCAB, HIDDEN, parallel)
    layer.weight.weight_loader(layer.weight, TABLE)
    return layer


def test_one_rank_is_a_plain_embedding():
    layer = loaded(VocabParallelEmbedding, ParallelContext())
    ids = torch.tensor([0, 10, 3, 3])
    assert torch.equal(layer(ids), F.embedding(ids, TABLE))


def test_ranks_own_contiguous_ranges_and_padding_rows_are_zero():
    layers = [loaded(VocabParallelEmbedding, parallel) for parallel in ranks(2)]
    assert [(layer.vocab_start, layer.vocab_end, layer.rows_per_rank) for layer in layers] == [(0, 6, 6), (6, 11, 6)]
    assert torch.equal(layers[0].weight, TABLE[:6])
    assert torch.equal(layers[1].weight[:5], TABLE[6:]) and layers[1].weight[5].abs().sum() == 0


@pytest.mark.parametrize("tp_size", [2, 4])
def test_the_ranks_lookups_sum_to_the_whole_table(tp_size):
    contexts = ranks(tp_size)
    ids = torch.tensor([0, 5, 6, 10, 2])
    for parallel in contexts:
        loaded(VocabParallelEmbedding, parallel)(ids)
    total = sum(contexts[0].group.reduced.values())
    assert torch.equal(total, F.embedding(ids, TABLE))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_lm_head_logits_gathered_and_cut_to_the_vocabulary(tp_size):
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    results = [loaded(ParallelLMHead, parallel).compute_logits(hidden) for parallel in reversed(ranks(tp_size))]
    logits = results[-1]  # rank 0 runs last and gathers every shard
    assert all(r is None for r in results[:-1])  # the other ranks get nothing
    assert logits.shape == (3, VOCAB)
    torch.testing.assert_close(logits, hidden @ TABLE.T)
