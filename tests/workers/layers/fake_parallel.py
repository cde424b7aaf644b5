"""Tensor parallelism without torch.distributed: each rank's layer runs in turn in this process,
and the collectives see every rank's tensor through a shared `FakeGroup`. A unit test of a layer
then checks what each rank computes and what the collective makes of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.workers.parallel_state import ParallelContext


@dataclass
class FakeGroup:
    """What the ranks handed to the last collective, by rank."""

    reduced: dict[int, torch.Tensor] = field(default_factory=dict)
    gathered: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class FakeParallel(ParallelContext):
    """A rank whose all_reduce records its partial and returns it unchanged (the test sums them),
    and whose gather_to_first concatenates on rank 0 the shards of the ranks that ran before it."""

    group: FakeGroup = field(default_factory=FakeGroup)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.reduced[self.tp_rank] = tensor.clone()
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        self.group.gathered[self.tp_rank] = tensor
        if self.tp_rank != 0:
            return None
        return torch.cat([self.group.gathered[rank] for rank in range(self.tp_size)], dim=-1)


def ranks(tp_size: int) -> list[FakeParallel]:
    """The contexts of one TP group, sharing one FakeGroup."""
    group = FakeGroup()
    return [FakeParallel(tp_rank=rank, tp_size=tp_size, group=group) for rank in range(tp_size)]
