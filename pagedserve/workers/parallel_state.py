"""Where this rank sits in the tensor- and pipeline-parallel grid, and the collectives it uses.

Ranks are laid out `rank = pp_rank * tp_size + tp_rank`: a pipeline stage is a contiguous run of
ranks. At world size 1 every collective is a no-op, so the models need no special case.
The context is passed explicitly to every layer that needs it (no module-level globals).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.config import EngineConfig


@dataclass
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed group of this rank's stage (None at tp_size 1)
    pp_group: Any = None  # torch.distributed group of ranks with this tp_rank (None at pp_size 1)
    tp_ranks: list[int] = field(default_factory=lambda: [0])  # global ranks in tp_group
    pp_ranks: list[int] = field(default_factory=lambda: [0])  # global ranks in pp_group

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The one rank that samples and returns tokens: the last stage's first TP rank."""
        return self.is_last_stage and self.tp_rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Concatenate the TP ranks' last-dim shards on TP rank 0; the others get None."""
        if self.tp_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(tensor, parts, dst=self.tp_ranks[0], group=self.tp_group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def send_to_next_stage(self, tensor: torch.Tensor) -> None:
        dist.send(tensor.contiguous(), dst=self.pp_ranks[self.pp_rank + 1], group=self.pp_group)

    def recv_from_previous_stage(self, shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=self.pp_ranks[self.pp_rank - 1], group=self.pp_group)
        return tensor


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Contiguous layers of one stage; when they do not divide evenly the first stages get one more."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


def init_parallel_context(rank: int, config: EngineConfig, init_method: str, backend: str, timeout_s: float = 120.0) -> ParallelContext:
    """Join the process group and build the TP and PP groups. Every rank creates every group, in
    the same order (torch.distributed requires it), and keeps the ones it belongs to."""
    import datetime

    tp_size, pp_size, world_size = config.tensor_parallel_size, config.pipeline_parallel_size, config.world_size
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _rendezvous_store(init_method, rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    tp_rank, pp_rank = rank % tp_size, rank // tp_size
    context = ParallelContext(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size)
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if stage == pp_rank:
            context.tp_group, context.tp_ranks = group, ranks
    for column in range(tp_size):
        ranks = list(range(column, world_size, tp_size))
        group = dist.new_group(ranks) if pp_size > 1 else None
        if column == tp_rank:
            context.pp_group, context.pp_ranks = group, ranks
    return context


def _rendezvous_store(init_method: str, rank: int, world_size: int, timeout: Any) -> dist.TCPStore:
    """The `tcp://host:port` rendezvous store, listening on `host` only. torch's own tcp:// init
    method makes rank 0's store listen on every interface whatever the host says; handing it a
    socket bound to the host (loopback when all ranks share a node) keeps other machines out."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(init_method)
    if address.scheme != "tcp" or address.hostname is None or address.port is None:
        raise ValueError(f"distributed init method must be tcp://host:port, got {init_method!r}")
    listen_fd = None
    if rank == 0:
        # detach(): the store owns the descriptor from now on (a Python socket would close it when collected).
        listen_fd = socket.create_server((address.hostname, address.port)).detach()
    return dist.TCPStore(
        address.hostname, address.port, world_size, rank == 0, timeout=timeout, master_listen_fd=listen_fd
    )
