"""Random ragged batches over a paged KV cache, shaped as the model runner builds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pagedserve.kernels import AttentionMetadata, reference


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]: this step's new K/V
    value: torch.Tensor
    kv_cache: torch.Tensor  # reference layout, holding random earlier context (not yet this step's)
    meta: AttentionMetadata
    scale: float


def make_batch(
    query_lens: list[int],
    context_lens: list[int],  # tokens cached before each sequence's chunk
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Sequences in the given order (decodes must come first, longest first, as the runner sorts
    them). Every sequence owns a random, out-of-order set of blocks; the table is padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    owners = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    slots, start = [], 0
    for i, (n, q, c) in enumerate(zip(blocks_per_seq, query_lens, context_lens)):
        table[i, :n] = torch.tensor(owners[start : start + n], dtype=torch.int32)
        start += n
        positions = torch.arange(c, c + q)
        slots.append(table[i, positions // block_size].long() * block_size + positions % block_size)
    num_tokens = sum(query_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        num_decodes=_num_leading_decodes(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_host=qsl,
        seq_lens_host=seq_lens,
    )
    kv_cache = randn(2, num_kv_heads, num_blocks, block_size, head_dim)
    return PagedBatch(
        query=randn(num_tokens, num_heads, head_dim),
        key=randn(num_tokens, num_kv_heads, head_dim),
        value=randn(num_tokens, num_kv_heads, head_dim),
        kv_cache=kv_cache,
        meta=meta,
        scale=head_dim**-0.5,
    )


def _num_leading_decodes(query_lens: list[int]) -> int:
    count = 0
    while count < len(query_lens) and query_lens[count] == 1:
        count += 1
    assert all(q > 1 for q in query_lens[count:]), "decodes must come first"
    return count


def random_lengths(num_decodes: int, num_prefills: int, max_context: int, max_query: int, seed: int):
    """(query_lens, context_lens) with decodes first, longest first; prefills ragged, some with
    cached context (chunked prefill or prefix hits) and some without."""
    gen = torch.Generator().manual_seed(seed)
    decode_ctx = sorted((int(x) for x in torch.randint(0, max_context, (num_decodes,), generator=gen)), reverse=True)
    prefill_q = [int(x) for x in torch.randint(2, max(max_query, 2) + 1, (num_prefills,), generator=gen)]
    prefill_ctx = [int(x) if i % 2 else 0 for i, x in enumerate(torch.randint(0, max_context, (num_prefills,), generator=gen))]
    return [1] * num_decodes + prefill_q, decode_ctx + prefill_ctx


# Fast paths against the reference in float32 on the same rounded inputs. float32: summation order
# (and the native kernel's vectorized exp) alone; half precision: the bounds of `assert_rounded`.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}  # half an ulp, relative
# The native kernel's own float32 error (order of sums, vectorized exp): at most 1.4e-6 measured
# over test_cpu_native's cases in float32, where outputs are of order 1.
FLOAT32_SLACK = 4e-6


def half_ulp(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of `dtype` numbers at each of `values` (subnormals: the fixed spacing)."""
    exponent = torch.floor(torch.log2(values.abs().clamp_min(torch.finfo(dtype).smallest_normal)))
    return UNIT_ROUNDOFF[dtype] * torch.exp2(exponent)


def assert_rounded(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, per_row: bool = False, roundings: int = 1,
    extra: torch.Tensor | None = None,
) -> None:
    """`actual` (in `dtype`) is the float32 `expected` rounded: within `roundings` half-ulps of each
    value (plus FLOAT32_SLACK), or with `per_row`, within `roundings` unit roundoffs of the row's
    largest value (a path that rounds intermediates, such as torch's attention rounding its
    probabilities before they weight V). A store that truncates instead of rounding fails the
    first: it is off by up to a whole ulp. `extra` adds a derived bound, per value, for an
    intermediate rounding the kernel makes before its store."""
    error = (actual.float() - expected).abs()
    if per_row:
        bound = roundings * UNIT_ROUNDOFF[dtype] * expected.abs().amax(-1, keepdim=True)
    else:
        # The half-ulp where the value was stored: an intermediate error can cross a power of two.
        stored = torch.maximum(expected.abs(), actual.float().abs())
        bound = roundings * half_ulp(stored, dtype) + FLOAT32_SLACK
    if extra is not None:
        bound = bound + extra
    excess = error - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{int((excess > 0).sum())} of {error.numel()} values beyond {roundings} rounding(s) of {dtype}; worst: "
        f"{actual.float().flatten()[worst].item()!r} for {expected.flatten()[worst].item()!r}"
    )


def check_against_reference(batch: PagedBatch, attention: Callable[..., torch.Tensor], per_row: bool = False, roundings: int = 1) -> None:
    """`attention` (a backend's `paged_attention`) on `batch` equals the float32 reference: within
    float32's summation noise, or in half precision as `assert_rounded` bounds it."""
    cache = batch.kv_cache.clone()
    reference.write_kv_cache(batch.key, batch.value, cache, batch.meta.slot_mapping)
    f32 = [t.float() for t in (batch.query, batch.key, batch.value, cache)]
    expected = reference.paged_attention(*f32, batch.meta, batch.scale)
    actual = attention(batch.query, batch.key, batch.value, cache, batch.meta, batch.scale)
    assert actual.dtype == batch.query.dtype and actual.shape == batch.query.shape
    if batch.query.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    else:
        assert_rounded(actual, expected, batch.query.dtype, per_row, roundings)
