"""One linear layer's adapters on this rank, and the low-rank products added to its output.

A layer holds, per resident adapter, `A` [r_total, in] and `B` [out, r_total] already cut to this
rank's shard, so that `x A^T B^T` is exactly this rank's share of the adapter's delta:
- column-parallel layers (q/k/v in the fused qkv, gate/up in the fused gate_up): B's rows are the
  rank's output rows, placed where the base layer places them, one block of columns per fused
  projection (B is block-diagonal over them, A their ranks stacked), so one pair of matmuls
  serves every projection the adapter targets;
- row-parallel layers (o, down): A's columns are the rank's input columns; the product is added
  to the rank's partial sum before the all-reduce, which sums the shards as it sums the base's.
The B rows come from the base layer's own weight loader, so the shards match its split exactly."""

from __future__ import annotations

from typing import Any

import torch


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
    stay the base model's)."""
    adapters = layer.lora_weights
    for lora_id, rows in groups.groups:
        weights = adapters.get(lora_id)
        if weights is None:
            continue
        a, b = weights
        if isinstance(rows, slice):
            out[rows] += low_rank_product(x[rows], a, b)
        else:
            out.index_add_(0, rows, low_rank_product(x.index_select(0, rows), a, b))
    return out


# Rows of one adapter up to which its product runs in float32. oneDNN's bf16 matmul costs ~40 us
# whatever the size below a few dozen rows, float32 10-20 us; from ~64 rows on bf16 is faster
# (1 row: 41 vs 14 us; 64: 57 vs 67; 2048: 0.50 vs 1.10 ms, a qkv-sized pair on a 2-core Zen 4).
FLOAT32_MAX_ROWS = 32


def low_rank_product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`x A^T B^T` in x's dtype. A and B are kept in float32 (workers/lora/manager.py): decode
    steps bring few rows per adapter, where float32 is faster and rounds once, at the end; a
    larger group (a prefill chunk) runs in x's dtype."""
    if x.dtype == a.dtype or x.shape[0] <= FLOAT32_MAX_ROWS:
        return ((x.to(a.dtype) @ a.t()) @ b.t()).to(x.dtype)
    return (x @ a.to(x.dtype).t()) @ b.to(x.dtype).t()
