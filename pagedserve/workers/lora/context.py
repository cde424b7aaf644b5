"""The step's rows of each adapter, for the linear layers to read during the forward pass (as
attention reads its metadata from its forward context): set around the model's forward by the
model runner, None when no row of the step has an adapter, so the base model pays nothing."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch


@dataclass(frozen=True)
class LoRAGroups:
    """Each adapter of the step (by lora_int_id) and its token rows: a slice when its rows are
    contiguous (one request, or requests next to each other), else an index tensor. On the CPU,
    also the native kernel's view of the same (layer_lora.add_lora): the step's adapters in
    order (`kernel_ids`) and each row's place among them or -1 (`kernel_rows`)."""

    groups: list[tuple[int, slice | torch.Tensor]]
    kernel_ids: list[int] = field(default_factory=list)
    kernel_rows: torch.Tensor | None = None

    @classmethod
    def of(cls, token_lora_ids: np.ndarray, device: torch.device) -> LoRAGroups | None:
        """From each token's lora_int_id (0: the base model); None when all are 0."""
        ids = np.unique(token_lora_ids)
        groups, kernel_ids = [], []
        kernel_rows = np.full(len(token_lora_ids), -1, dtype=np.int64)
        for lora_id in ids[ids > 0].tolist():
            rows = np.flatnonzero(token_lora_ids == lora_id)
            contiguous = rows[-1] - rows[0] + 1 == len(rows)
            group = (lora_id, slice(int(rows[0]), int(rows[-1]) + 1) if contiguous else torch.from_numpy(rows).to(device))
            groups.append(group)
            if device.type == "cpu":
                kernel_rows[rows] = len(kernel_ids)
                kernel_ids.append(lora_id)
        if not groups:
            return None
        return cls(groups, kernel_ids, torch.from_numpy(kernel_rows) if kernel_ids else None)


_current: LoRAGroups | None = None


@contextlib.contextmanager
def lora_context(groups: LoRAGroups | None) -> Iterator[None]:
    global _current
    previous, _current = _current, groups
    try:
        yield
    finally:
        _current = previous


def current_groups() -> LoRAGroups | None:
    return _current
