"""The Triton paged-attention and cache-write kernels against the torch reference.

On the CPU they run in Triton's interpreter (see conftest.py), so the shapes here are small;
the `gpu` tests repeat them at serving sizes. Every batch has out-of-order block tables (random
permutations) padded past the longest sequence, ragged lengths and partial last blocks.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86-64 Linux only)")

import torch

from pagedserve.kernels import reference, triton_attention, triton_cache
from tests.kernels.conftest import DEVICE
from tests.kernels.paged_batch import UNIT_ROUNDOFF, PagedBatch, assert_rounded, make_batch, random_lengths

# name -> (query_lens, context_lens); decodes first, longest context first, as the runner orders.
CASES = {
    # Contexts on and off block boundaries, and a decode of a one-token sequence.
    "decode_only": ([1, 1, 1, 1, 1], [70, 33, 32, 15, 0]),
    # Nothing cached: the whole prompt in one chunk; lengths across block boundaries.
    "prefill_only": ([17, 2, 40, 8], [0, 0, 0, 0]),
    # Chunks after cached context (chunked prefill or prefix-cache hits).
    "chunked_prefill": ([16, 9], [48, 5]),
    "mixed": ([1, 1, 1, 12, 30, 3], [50, 17, 8, 0, 21, 64]),
}
# float32: summation order alone (tl.dot in IEEE precision, float32 accumulators).
FLOAT32_TOLERANCE = 2e-5


def check_against_reference(batch: PagedBatch, num_splits: int | None = None) -> None:
    ref_cache = batch.kv_cache.clone()
    reference.write_kv_cache(batch.key, batch.value, ref_cache, batch.meta.slot_mapping)
    tri_cache = batch.kv_cache.clone()
    triton_cache.write_kv_cache(batch.key, batch.value, tri_cache, batch.meta.slot_mapping)
    assert torch.equal(tri_cache, ref_cache), "write_kv_cache differs from the reference"

    # The reference in float32 on the same (rounded) inputs: the kernel accumulates in float32.
    f32 = [t.float() for t in (batch.query, batch.key, batch.value, ref_cache)]
    expected = reference.paged_attention(*f32, batch.meta, batch.scale)
    actual = triton_attention.paged_attention(
        batch.query, batch.key, batch.value, tri_cache, batch.meta, batch.scale, num_splits=num_splits
    )
    assert actual.dtype == batch.query.dtype and actual.shape == batch.query.shape
    dtype = batch.query.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=FLOAT32_TOLERANCE, rtol=FLOAT32_TOLERANCE)
    else:
        assert_rounded(actual, expected, dtype, roundings=store_roundings(dtype), extra=probability_rounding_bound(batch, f32, dtype))


def store_roundings(dtype: torch.dtype) -> int:
    """Compiled, the store rounds to nearest: one half-ulp. Triton's interpreter converts float32
    to bfloat16 by truncation (-2.0623 becomes -2.046875, not -2.0625: seen with triton 3.7),
    up to a whole ulp, so there the bound is two half-ulps; the GPU tests hold the kernel to one."""
    return 2 if triton_attention.IS_INTERPRETED and dtype == torch.bfloat16 else 1


def probability_rounding_bound(batch: PagedBatch, f32: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
    """What rounding the probabilities can add before the one rounding of the store. The kernel
    rounds each probability p_j to `dtype` for `tl.dot(p, v)` and keeps the float32 sum of the
    unrounded p_j as the denominator, so the output moves by sum_j p_j d_j v_j / sum_j p_j with
    |d_j| <= u: at most u times the attention of the same query over |V|. The interpreter's bf16
    path (UPCAST) multiplies float32 copies and rounds nothing but the store."""
    if triton_attention.IS_INTERPRETED and dtype == torch.bfloat16:
        return None
    query, key, value, cache = f32
    abs_cache = cache.clone()
    abs_cache[1] = cache[1].abs()  # [K or V, kv_heads, blocks, block_size, head_dim]
    weighted = reference.paged_attention(query, key, value.abs(), abs_cache, batch.meta, batch.scale)
    return UNIT_ROUNDOFF[dtype] * weighted


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1), (6, 2)], ids=["mha", "gqa2", "mqa", "gqa3"])
@pytest.mark.parametrize("case", list(CASES))
def test_batch_shapes_and_head_groups(case, heads):
    query_lens, context_lens = CASES[case]
    batch = make_batch(query_lens, context_lens, heads[0], heads[1], head_dim=32, block_size=16, device=DEVICE)
    check_against_reference(batch)


@pytest.mark.parametrize("block_size", [8, 32, 64, 128])
def test_block_sizes(block_size):
    batch = make_batch(*CASES["mixed"], num_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size, device=DEVICE, seed=1)
    check_against_reference(batch)


@pytest.mark.parametrize("head_dim", [24, 64, 96, 128, 256])
def test_head_sizes(head_dim):
    """Non-powers of two (24, 96) are padded to the next one and masked."""
    batch = make_batch(*CASES["mixed"], num_heads=2, num_kv_heads=1, head_dim=head_dim, block_size=16, device=DEVICE, seed=2)
    check_against_reference(batch)


@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize("case", ["decode_only", "mixed"])
def test_split_kv(case, num_splits):
    """Each split's partial softmax merged by the second kernel; with 8 splits of the 1-2 tiles a
    short sequence has, most splits are empty and must contribute nothing."""
    batch = make_batch(*CASES[case], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, device=DEVICE, seed=3)
    check_against_reference(batch, num_splits=num_splits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    batch = make_batch(*CASES["mixed"], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, device=DEVICE, seed=4)
    check_against_reference(batch)


def test_many_query_heads_per_kv_head():
    """A group wider than the 16-row tile: one query token per tile, 32 heads."""
    batch = make_batch(*CASES["chunked_prefill"], num_heads=32, num_kv_heads=1, head_dim=32, block_size=16, device=DEVICE, seed=5)
    check_against_reference(batch)


@pytest.mark.parametrize("seed", [10, 11])
def test_random_ragged_batches(seed):
    query_lens, context_lens = random_lengths(num_decodes=4, num_prefills=3, max_context=80, max_query=24, seed=seed)
    batch = make_batch(query_lens, context_lens, 4, 2, head_dim=32, block_size=16, device=DEVICE, seed=seed)
    check_against_reference(batch)


def test_write_skips_padding_slots_and_reads_strided_inputs():
    """Slot -1 (CUDA-graph padding) writes nothing; K/V may be strided views of a fused QKV."""
    batch = make_batch([5], [3], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, device=DEVICE)
    qkv = torch.randn(5, 3, 2 * 32, device=DEVICE)
    key, value = qkv[:, 0].view(5, 2, 32), qkv[:, 1].view(5, 2, 32)  # token stride 192, not 64
    slots = batch.meta.slot_mapping.clone()
    slots[[1, 3]] = -1
    expected = batch.kv_cache.clone()
    keep = slots >= 0
    reference.write_kv_cache(key[keep], value[keep], expected, slots[keep])
    actual = batch.kv_cache.clone()
    triton_cache.write_kv_cache(key, value, actual, slots)
    assert torch.equal(actual, expected)


# ---- serving sizes, compiled on a GPU ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_mixed_batch(dtype, block_size, head_dim):
    query_lens, context_lens = random_lengths(num_decodes=48, num_prefills=16, max_context=2000, max_query=300, seed=20)
    batch = make_batch(query_lens, context_lens, 32, 8, head_dim, block_size, dtype=dtype, device="cuda", seed=20)
    check_against_reference(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("num_decodes", [1, 32, 256])
def test_gpu_decode_batches_default_splits(num_decodes):
    """Decode-only batches take the split-KV path by default when they are small."""
    query_lens, context_lens = random_lengths(num_decodes, 0, max_context=4000, max_query=1, seed=21)
    batch = make_batch(query_lens, context_lens, 32, 8, 64, 16, dtype=torch.bfloat16, device="cuda", seed=21)
    check_against_reference(batch)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [32, 96, 256])
def test_gpu_other_head_sizes(head_dim):
    query_lens, context_lens = random_lengths(num_decodes=16, num_prefills=4, max_context=700, max_query=200, seed=22)
    batch = make_batch(query_lens, context_lens, 16, 4, head_dim, 16, dtype=torch.bfloat16, device="cuda", seed=22)
    check_against_reference(batch)
