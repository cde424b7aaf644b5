"""One linear layer's adapters on this rank, and the low-rank products added to its output.

A layer holds, per resident adapter, `A^T` [in, r_total] and `B^T` [r_total, out] (transposed, as
the native kernel reads them, with `kernel_ranges(B^T)`) already cut to this rank's shard, so that
`x A^T B^T` is exactly this rank's share of the adapter's delta:
- column-parallel layers (q/k/v in the fused qkv, gate/up in the fused gate_up): B's rows are the
  rank's output rows, placed where the base layer places them, one block of columns per fused
  projection (B is block-diagonal over them, A their ranks stacked), so one pair of matmuls
  serves every projection the adapter targets;
- row-parallel layers (o, down): A's columns are the rank's input columns; the product is added
  to the rank's partial sum before the all-reduce, which sums the shards as it sums the base's.
The B rows come from the base layer's own weight loader, so the shards match its split exactly."""

from __future__ import annotations

import functools
from typing import Any

import torch

from pagedserve.kernels import cpu_native


def shard_for_layer(layer: Any, parts: dict[Any, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of the adapter's `parts` (shard id -> full A [r, in], B [out, r]) on
    `layer` (shard ids as the base layer's loader takes them: "q"/"k"/"v", 0/1, or None)."""
    if hasattr(layer, "input_size_per_rank"):  # row-parallel: one part, A's columns split
        [(a, b)] = parts.values()
        start = layer.parallel.tp_rank * layer.input_size_per_rank
        return a[:, start : start + layer.input_size_per_rank].contiguous(), b.contiguous()
    out_rows = layer.output_size_per_rank
    ranks = [a.shape[0] for a, _ in parts.values()]
    big_b = torch.zeros(out_rows, sum(ranks))
    column = 0
    for (shard_id, (_, b)), rank in zip(parts.items(), ranks):
        layer.weight_loader(big_b[:, column : column + rank], b, shard_id)  # this rank's rows, where the base puts them
        column += rank
    return torch.cat([a for a, _ in parts.values()]), big_b


def add_lora(layer: Any, x: torch.Tensor, out: torch.Tensor, groups: Any) -> torch.Tensor:
    """`out` plus each adapted row's low-rank product (rows of an adapter this layer has none of
    stay the base model's). On the CPU the groups of at most KERNEL_MAX_ROWS rows go through the
    native kernel in one call; larger groups, and every group without the kernel, one adapter at
    a time in torch."""
    adapters = layer.lora_weights
    remaining = groups.groups
    if groups.kernel_rows is not None and out.is_contiguous() and cpu_native.is_available():
        no_adapter = _no_adapter(x.shape[1], out.shape[1])
        weights = [adapters.get(lora_id, no_adapter) for lora_id in groups.kernel_ids]
        a_t, b_t, k_ranges = ([w[i] for w in weights] for i in range(3))
        torch.ops.pagedserve_cpu.lora_add(out, x.contiguous(), groups.kernel_rows, a_t, b_t, k_ranges)
        remaining = groups.large
    for lora_id, rows in remaining:
        weights = adapters.get(lora_id)
        if weights is None:
            continue
        a_t, b_t, _ = weights
        if isinstance(rows, slice):
            out[rows] += low_rank_product(x[rows], a_t, b_t)
        else:
            out.index_add_(0, rows, low_rank_product(x.index_select(0, rows), a_t, b_t))
    return out


@functools.lru_cache(maxsize=64)
def _no_adapter(in_features: int, out_features: int) -> tuple[torch.Tensor, ...]:
    """A rank-0 adapter: what the kernel gets for a step's adapter that does not target a layer
    of these sizes."""
    b_t = torch.empty(0, out_features)
    return torch.empty(in_features, 0), b_t, kernel_ranges(b_t)


KERNEL_CHUNK = 16  # output columns per entry of the kernel's k_ranges (csrc/cpu_lora.cpp's CHUNK)


def kernel_ranges(b_t: torch.Tensor) -> torch.Tensor:
    """For each KERNEL_CHUNK output columns of B^T [r, out], the rank rows [lo, hi) with a nonzero
    there (int64 [chunks, 2]; (0, 0) for none). A fused layer's B^T is block-diagonal over its
    projections, so the kernel's product with it then skips the zero blocks."""
    rank, width = b_t.shape
    chunks = -(-width // KERNEL_CHUNK)
    if rank == 0:
        return torch.zeros(chunks, 2, dtype=torch.long)
    nonzero = torch.zeros(rank, chunks * KERNEL_CHUNK, dtype=torch.bool)
    nonzero[:, :width] = b_t != 0
    used = nonzero.view(rank, chunks, KERNEL_CHUNK).any(-1)  # [rank, chunks]
    has_any = used.any(0)
    lo = used.int().argmax(0)  # the first rank row used
    hi = rank - used.flip(0).int().argmax(0)  # one past the last
    return torch.stack([torch.where(has_any, lo, 0), torch.where(has_any, hi, 0)], dim=1).long().contiguous()


# Rows of one adapter up to which its product runs in float32 where the kernel is not there.
# oneDNN's bf16 matmul costs ~40 us whatever the size below a few dozen rows, float32 10-20 us;
# from ~64 rows on bf16 is faster (1 row: 41 vs 14 us; 64: 57 vs 67; 2048: 0.50 vs 1.10 ms, a
# qkv-sized pair on a 2-core Zen 4).
FLOAT32_MAX_ROWS = 32
# Rows of one adapter up to which the native kernel takes its product. On a 2-core Zen 4, one
# adapter of rank 8 on every projection, for 64 / 128 / 256 / 512 rows (benchmarks/lora_kernel.py):
# qkv (576 in, 960 out) 25 / 45 / 84 / 175 us against 78 / 100 / 137 / 212 for torch in bf16,
# gate_up (3072 out) 38 / 73 / 139 / 281 against 101 / 142 / 213 / 372, down (1536 in, 576 out)
# 26 / 48 / 92 / 182 against 68 / 81 / 113 / 164. Past 256 torch's bf16 matmul draws level.
KERNEL_MAX_ROWS = 256


def low_rank_product(x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """`x A^T B^T` in x's dtype, from A^T [in, r] and B^T [r, out]. They are kept in float32 on
    the CPU (workers/lora/manager.py): decode steps bring few rows per adapter, where float32 is
    faster and rounds once, at the end; a larger group (a prefill chunk) runs in x's dtype."""
    if x.dtype == a_t.dtype or x.shape[0] <= FLOAT32_MAX_ROWS:
        return ((x.to(a_t.dtype) @ a_t) @ b_t).to(x.dtype)
    return (x @ a_t.to(x.dtype)) @ b_t.to(x.dtype)
