"""The fast CPU backend (`cpu_attention`) against the torch reference: ragged decode batches
grouped by length, GQA/MQA, partial last blocks, mixed decode + prefill batches, float32 and
bfloat16. Every batch has out-of-order block tables padded past the longest sequence."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_attention
from tests.kernels.paged_batch import PagedBatch, make_batch, random_lengths
from tests.kernels.paged_batch import check_against_reference as check_with

CASES = {
    "decode_only": ([1, 1, 1, 1, 1], [70, 33, 32, 15, 0]),
    "prefill_only": ([17, 2, 40, 8], [0, 0, 0, 0]),
    "chunked_prefill": ([16, 9], [48, 5]),
    "mixed": ([1, 1, 1, 12, 30, 3], [50, 17, 8, 0, 21, 64]),
}


def check_against_reference(batch: PagedBatch) -> None:
    # torch's fused attention rounds its probabilities to bf16 before they weight V: each output
    # is within two roundings of its row's scale (1.5 measured), not of its own value.
    check_with(batch, cpu_attention.paged_attention, per_row=True, roundings=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa3", "mqa"])
@pytest.mark.parametrize("case", list(CASES))
def test_against_reference(case, heads, dtype):
    batch = make_batch(*CASES[case], heads[0], heads[1], head_dim=32, block_size=16, dtype=dtype)
    check_against_reference(batch)


@pytest.mark.parametrize("block_size", [1, 8, 64])
def test_block_sizes(block_size):
    batch = make_batch(*CASES["mixed"], num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size, seed=1)
    check_against_reference(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [10, 11])
def test_random_ragged_batches(seed, dtype):
    query_lens, context_lens = random_lengths(num_decodes=12, num_prefills=3, max_context=200, max_query=24, seed=seed)
    batch = make_batch(query_lens, context_lens, 9, 3, head_dim=64, block_size=16, dtype=dtype, seed=seed)
    check_against_reference(batch)


def test_decodes_split_into_several_groups(monkeypatch):
    """Lengths far apart, and a gather budget of a few rows: many groups, some of one row, some
    padded and masked; the answer must not depend on where the groups are cut."""
    monkeypatch.setattr(cpu_attention, "DECODE_GROUP_BYTES", 4 * 2 * 2 * 32 * 4 * 96)
    lens = [190, 180, 170, 120, 64, 63, 40, 17, 16, 3, 1]
    groups = cpu_attention.decode_row_groups(lens, 16, 2 * 2 * 32 * 4)
    assert len(groups) > 4 and groups[0][0] == 0 and groups[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in zip(groups, groups[1:]))  # contiguous, in order
    batch = make_batch([1] * len(lens), [n - 1 for n in lens], 4, 2, head_dim=32, block_size=16, seed=3)
    check_against_reference(batch)


def test_row_groups_bound_padding():
    # 100 and 20 tokens: padding the short row to the long one would waste most of the gather.
    assert cpu_attention.decode_row_groups([100, 20], 16, 64) == [(0, 1), (1, 2)]
    assert cpu_attention.decode_row_groups([100, 98, 97], 16, 64) == [(0, 3)]
