"""One linear layer's adapters on this rank, and the low-rank products added to its output.

A layer holds, per resident adapter, an `AdapterWeights`: `A^T` [in, r_total] and each adapted
projection's `B^T` [r_p, width_p] (transposed, as the native kernel reads them), already cut to
this rank's shard, so that `x A^T B^T` is exactly this rank's share of the adapter's delta:
- column-parallel layers (q/k/v in the fused qkv, gate/up in the fused gate_up): A stacks the
  projections' ranks, and each projection's B^T covers only that projection's output columns,
  where the base layer places them (found through the base layer's own weight loader, so the
  shards match its split exactly). One x A^T serves every projection the adapter targets; the
  columns of a projection it does not target are left alone;
- row-parallel layers (o, down): A's columns are the rank's input columns; the product is added
  to the rank's partial sum before the all-reduce, which sums the shards as it sums the base's.
Before, a fused layer's B was one block-diagonal [out, r_total] matrix, whose zeros took half of
gate_up's B and two thirds of qkv's, and which torch's products multiplied."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedserve.kernels import cpu_native

KERNEL_CHUNK = 16  # output columns per kernel segment at most (csrc/cpu_lora.cpp's CHUNK)


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter on one layer of this rank. `b` holds each projection's B^T [rank, width]
    row-major, one after another; `parts` says where: (first output column, width, first rank
    row of A^T, rank, offset in `b`). `segments` is the native kernel's view of the same,
    int64 [S, 6]: (first column, columns <= 16, rank rows lo, hi, offset in `b` of row lo, row
    stride), each segment inside one projection."""

    a_t: torch.Tensor
    b: torch.Tensor
    parts: tuple[tuple[int, int, int, int, int], ...]
    segments: torch.Tensor

    @classmethod
    def build(cls, a_t: torch.Tensor, blocks: list[tuple[int, torch.Tensor]]) -> AdapterWeights:
        """From A^T [in, r_total] and each projection's (first column, B^T [r_p, width_p]), in
        A's rank order; on A^T's device and in its dtype."""
        parts, segments, flat, row, offset = [], [], [], 0, 0
        for column, b_t in blocks:
            rank, width = b_t.shape
            parts.append((column, width, row, rank, offset))
            for first in range(0, width, KERNEL_CHUNK):
                segments.append((column + first, min(KERNEL_CHUNK, width - first), row, row + rank, offset + first, width))
            flat.append(b_t.reshape(-1))
            row, offset = row + rank, offset + b_t.numel()
        if row != a_t.shape[1]:
            raise ValueError(f"the projections' ranks sum to {row}, A^T has {a_t.shape[1]} columns")
        b = torch.cat(flat).to(a_t) if flat else a_t.new_empty(0)
        return cls(a_t, b, tuple(parts), torch.tensor(segments, dtype=torch.long, device=a_t.device).reshape(-1, 6))

    @property
    def nbytes(self) -> int:
        return self.a_t.nbytes + self.b.nbytes

    def to(self, device: torch.device) -> AdapterWeights:
        """A copy on `device` (itself where it already is); from pinned host memory the copies
        are queued without waiting, ahead of the step's kernels on the same stream."""
        return self._map(lambda tensor: tensor.to(device, non_blocking=True))

    def pinned(self) -> AdapterWeights:
        """The same weights in page-locked host memory, from which a GPU copies asynchronously."""
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn) -> AdapterWeights:
        return replace(self, a_t=fn(self.a_t), b=fn(self.b), segments=fn(self.segments))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.a_t, self.b, self.segments

    def b_t(self, index: int) -> torch.Tensor:
        """Projection `index`'s B^T [rank, width], a view of `b`."""
        _, width, _, rank, offset = self.parts[index]
        return self.b[offset : offset + rank * width].view(rank, width)


def shard_for_layer(layer: Any, parts: dict[Any, tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """This rank's A [r_total, in] and, for each projection, (first output column, B [width, r])
    of the adapter's `parts` (shard id -> full A [r, in], B [out, r]) on `layer` (shard ids as
    the base layer's loader takes them: "q"/"k"/"v", 0/1, or None)."""
    if hasattr(layer, "input_size_per_rank"):  # row-parallel: one part, A's columns split
        [(a, b)] = parts.values()
        start = layer.parallel.tp_rank * layer.input_size_per_rank
        return a[:, start : start + layer.input_size_per_rank].contiguous(), [(0, b.contiguous())]
    out_rows = layer.output_size_per_rank
    blocks = []
    for shard_id, (_, b) in parts.items():
        # The base loader copies this rank's rows of the projection to where it keeps them; a
        # column of ones marks which rows those are.
        placed, marker = torch.zeros(out_rows, b.shape[1]), torch.zeros(out_rows, 1)
        layer.weight_loader(placed, b, shard_id)
        layer.weight_loader(marker, torch.ones(b.shape[0], 1), shard_id)
        rows = marker[:, 0].nonzero().flatten()
        first, width = int(rows[0]), len(rows)
        if int(rows[-1]) - first + 1 != width:
            raise ValueError(f"projection {shard_id!r} does not take contiguous rows of the layer")
        blocks.append((first, placed[first : first + width]))
    return torch.cat([a for a, _ in parts.values()]), blocks


def add_lora(layer: Any, x: torch.Tensor, out: torch.Tensor, groups: Any) -> torch.Tensor:
    """`out` plus each adapted row's low-rank product (rows of an adapter this layer has none of
    stay the base model's). On the CPU every group goes through the native kernel in one call;
    elsewhere, or without the kernel, one adapter at a time in torch.

    Groups of every size go to the kernel. For a group whose rows lie among others' (prefills of
    several adapters in one step) torch pays an index_select and an index_add_ into column slices
    per projection: over a layer of SmolLM2 that took 4-7x the kernel's time at 512-2048 rows; for
    a contiguous group, 1.1-2.3x, though torch wins o and down alone past 1024 rows
    (benchmarks/lora_kernel.py, lora_kernel_cpu.json's `one_adapter_group_per_layer`)."""
    adapters = layer.lora_weights
    if groups.kernel_rows is not None and out.is_contiguous() and cpu_native.is_available():
        no_adapter = _no_adapter(x.shape[1])
        weights = [adapters.get(lora_id, no_adapter) for lora_id in groups.kernel_ids]
        torch.ops.pagedserve_cpu.lora_add(
            out, x.contiguous(), groups.kernel_rows, [w.a_t for w in weights], [w.b for w in weights], [w.segments for w in weights]
        )
        return out
    for lora_id, rows in groups.groups:
        weights = adapters.get(lora_id)
        if weights is not None:
            add_low_rank(out, rows, x, weights)
    return out


@functools.lru_cache(maxsize=64)
def _no_adapter(in_features: int) -> AdapterWeights:
    """A rank-0 adapter: what the kernel gets for a step's adapter that does not target a layer
    of this input size."""
    return AdapterWeights.build(torch.empty(in_features, 0), [])


# Rows of one adapter up to which its product runs in float32 where the kernel is not there.
# oneDNN's bf16 matmul costs ~40 us whatever the size below a few dozen rows, float32 10-20 us;
# from ~64 rows on bf16 is faster (1 row: 41 vs 14 us; 64: 57 vs 67; 2048: 0.50 vs 1.10 ms, a
# qkv-sized pair on a 2-core Zen 4).
FLOAT32_MAX_ROWS = 32


def add_low_rank(out: torch.Tensor, rows: slice | torch.Tensor, x: torch.Tensor, weights: AdapterWeights) -> None:
    """out[rows] += x[rows] A^T B^T, one x A^T for every projection, then each projection's
    product into its own columns. The adapters are kept in float32 on the CPU (manager.py):
    a few rows (a decode step's) run in float32, which is faster there and rounds once, at the
    end; a larger group (a prefill chunk) runs in x's dtype."""
    x_rows = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
    h = _times_a_t(x_rows, weights.a_t)
    for index, (column, width, first, rank, _) in enumerate(weights.parts):
        delta = _times_b_t(h[:, first : first + rank], weights.b_t(index), x.dtype)
        if isinstance(rows, slice):
            out[rows, column : column + width] += delta
        else:
            out[:, column : column + width].index_add_(0, rows, delta)


def _times_a_t(x: torch.Tensor, a_t: torch.Tensor) -> torch.Tensor:
    if x.dtype == a_t.dtype or x.shape[0] <= FLOAT32_MAX_ROWS:
        return x.to(a_t.dtype) @ a_t
    return x @ a_t.to(x.dtype)


def _times_b_t(h: torch.Tensor, b_t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (h @ b_t.to(h.dtype)).to(dtype)
