"""The adapters one rank holds, kept by recency. The scheduler puts at most `max_loras` distinct
adapters in one step, so the adapters of the step in hand are never the ones evicted.

Where they live (`tiered`):
- on the CPU the layers read host memory, so every adapter held, up to
  `max(max_loras, max_cpu_loras)`, stays attached to its layers (`resident`);
- on a GPU, `max_loras` adapters sit in device memory attached to the layers (the slots), and
  up to `max_cpu_loras` (at least `max_loras`; the slots' adapters among them) are kept in pinned
  host memory (`host`). An adapter evicted from its slot returns from host memory, a copy queued
  on the step's stream, without reading its folder again; one evicted from host memory is read
  again when a request names it.

An adapter is read from its PEFT folder (each rank its own shard) on a thread of its own, as soon
as a step announces it (`prefetch`: the scheduler names the adapters its waiting requests need),
and installed at the start of the step that first runs one of its requests. The scheduler holds
such a request back until the sampling rank reports the adapter read (`ready_ids`), so the step
loop never waits for a disk; a rank whose read is still going when the request arrives finishes
it then, and one that never heard of the adapter reads it in the step, as before.

The weights live beside each linear layer (`layer.lora_weights`, layer_lora.py)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pagedserve.lora_request import LoRARequest
from pagedserve.workers.cpu_binding import release_current_thread
from pagedserve.workers.lora.layer_lora import AdapterWeights, shard_for_layer
from pagedserve.workers.lora.peft_adapter import check_adapter, read_adapter

logger = logging.getLogger(__name__)

# adapter projection -> (the module of our decoder layer it adapts, the base loader's shard id)
PROJECTIONS = {
    "q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"), "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", None),
}


# One adapter's weights for this rank: (module, its AdapterWeights) for each adapted module, and
# their bytes.
Prepared = tuple[list[tuple[Any, AdapterWeights]], int]


def _one_torch_thread() -> None:
    """The reader thread's torch ops run on one thread. With OpenMP (torch's CPU builds), a second
    Python thread that runs a parallel op gets a team of its own, and while that team lives the
    step thread's small ops slowed 10-20x on a 2-core Zen 4 (an index_add_ of 2 rows: 8 us before
    the reader's first read, 190-250 us after; 4 adapters at 8 decode rows: 260 ms a step against
    54 at 4 rows), which is every LoRA step's many low-rank products. One thread here has no team."""
    torch.set_num_threads(1)
    release_current_thread()  # started from the step thread: not on its one CPU (cpu_binding)


class WorkerLoRAManager:
    def __init__(
        self, model: Any, max_lora_rank: int, max_loras: int, max_cpu_loras: int | None, dtype: torch.dtype, device: torch.device,
        tiered: bool | None = None,
    ):
        self.layers = model.model.layers  # this stage's decoder layers, by index (a string)
        self.max_lora_rank = max_lora_rank
        self.dtype, self.device = dtype, device
        held = max(max_loras, max_cpu_loras or 0)
        self.tiered = device.type != "cpu" if tiered is None else tiered  # the module docstring says why
        self.slots = max_loras if self.tiered else held  # adapters attached to the layers at most
        self.host_capacity = held if self.tiered else 0
        self.read_capacity = held  # reads started ahead and not yet installed, at most
        # Adapters are held in float32 on the CPU, whatever the model's dtype (layer_lora.py's
        # add_low_rank: faster at decode sizes); a GPU keeps the model's dtype.
        self.lora_dtype = torch.float32 if device.type == "cpu" else dtype
        self.read_device = torch.device("cpu") if self.tiered else device
        self.resident: OrderedDict[int, str] = OrderedDict()  # lora_int_id -> its path, oldest first: attached
        self.host: OrderedDict[int, Prepared] = OrderedDict()  # tiered: lora_int_id -> its host copy, oldest first
        self.reading: dict[int, Future] = {}  # lora_int_id -> its read, started by prefetch
        self.retiring: set[int] = set()  # removed in the front end; dropped once no row uses them
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read", initializer=_one_torch_thread)

    def prefetch(self, requests: list[LoRARequest]) -> None:
        """Start reading the adapters a coming step will need, off the step. At most
        `read_capacity` reads are held: when full, finished reads this step does not name are
        let go (their request may have been aborted; one that comes back is read again), so a
        read nobody installs never keeps the others out. Reads that find no room start at a
        later step: the scheduler names their adapters again."""
        wanted = {request.lora_int_id for request in requests}
        for lora_id in [i for i, future in self.reading.items() if future.done() and i not in wanted]:
            if len(self.reading) < self.read_capacity:
                break
            del self.reading[lora_id]
        for request in requests:
            lora_id = request.lora_int_id
            if lora_id in self.resident or lora_id in self.host or lora_id in self.reading or len(self.reading) >= self.read_capacity:
                continue
            self.reading[lora_id] = self._reader.submit(self._read, request)

    def ready_ids(self) -> frozenset[int]:
        """The adapters a step can run without reading a file: attached, in host memory, or read.
        A failed read counts too: the step that needs it reads again and reports the error where
        it always did."""
        done = (i for i, future in self.reading.items() if future.done())
        return frozenset(self.resident) | frozenset(self.host) | frozenset(done)

    def ensure(self, requests: list[LoRARequest], in_use: set[int]) -> None:
        """Attach the adapters of `requests` not yet attached (from host memory, read ahead, or
        read now), then evict the least recent ones not `in_use` (the step's) beyond the slots,
        and beyond host memory's capacity those not attached."""
        for request in requests:
            lora_id = request.lora_int_id
            if lora_id in self.resident:
                self.resident.move_to_end(lora_id)
                if lora_id in self.host:
                    self.host.move_to_end(lora_id)
                continue
            self._install(request, self._host_copy(request))
        for lora_id in list(self.resident):
            if len(self.resident) <= self.slots:
                break
            if lora_id not in in_use:
                self._detach(lora_id)
        for lora_id in list(self.host):
            if len(self.host) <= self.host_capacity:
                break
            if lora_id not in self.resident:
                del self.host[lora_id]

    def retire(self, lora_ids: set[int]) -> None:
        """Adapters the front end removed: dropped by `drop_retired` once no request uses them."""
        self.retiring |= lora_ids

    def drop_retired(self, in_use: set[int]) -> None:
        for lora_id in self.retiring - in_use:
            self.remove(lora_id)
            self.reading.pop(lora_id, None)  # a read still going ends unheard
        self.retiring &= in_use

    def remove(self, lora_id: int) -> bool:
        """Forget the adapter on this rank: its slot and its host copy."""
        held = self.host.pop(lora_id, None) is not None
        return self._detach(lora_id) or held

    def _detach(self, lora_id: int) -> bool:
        if self.resident.pop(lora_id, None) is None:
            return False
        for module in self._modules():
            module.lora_weights.pop(lora_id, None)
        return True

    def _host_copy(self, request: LoRARequest) -> Prepared:
        """The adapter's weights as read (tiered: kept in host memory, where a later install
        finds them)."""
        lora_id = request.lora_int_id
        if lora_id in self.host:
            self.host.move_to_end(lora_id)
            return self.host[lora_id]
        prepared = self._take_read(request)
        if self.tiered:
            self.host[lora_id] = prepared
        return prepared

    def _take_read(self, request: LoRARequest) -> Prepared:
        future = self.reading.pop(request.lora_int_id, None)
        if future is not None:
            try:
                return future.result()  # at once when the scheduler waited for it
            except Exception:  # noqa: BLE001 - read again below: the step reports the error
                logger.warning("reading LoRA adapter %s ahead of its step failed; reading it again", request.lora_name)
        return self._read(request)

    def _read(self, request: LoRARequest) -> Prepared:
        """This rank's shard of the adapter's weights, in the dtype it runs in: on the device it
        runs on, or (tiered) in host memory."""
        weights = read_adapter(check_adapter(request.lora_path, self.max_lora_rank))
        by_module: dict[tuple[str, str], dict[Any, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer_index, projection), pair in weights.items():
            module_name, shard_id = PROJECTIONS[projection]
            by_module.setdefault((str(layer_index), module_name), {})[shard_id] = pair
        prepared, num_bytes = [], 0
        for (layer_index, module_name), parts in by_module.items():
            if layer_index not in self.layers:
                continue  # another pipeline stage's layer
            module = self.layers[layer_index].get_submodule(module_name)
            a, blocks = shard_for_layer(module, parts)
            a_t = a.t().to(self.read_device, self.lora_dtype).contiguous()
            weights = AdapterWeights.build(a_t, [(column, b.t()) for column, b in blocks])
            if self.tiered and self.device.type == "cuda":
                weights = weights.pinned()
            prepared.append((module, weights))
            num_bytes += weights.nbytes
        return prepared, num_bytes

    def _install(self, request: LoRARequest, prepared: Prepared) -> None:
        modules, num_bytes = prepared
        for module, weights in modules:
            module.lora_weights[request.lora_int_id] = weights.to(self.device) if self.tiered else weights
        self.resident[request.lora_int_id] = request.lora_path
        where = f"a {self.device.type} slot ({len(self.resident)} of {self.slots} used)" if self.tiered else "this rank"
        logger.info(
            "loaded LoRA adapter %s (id %d) from %s: %.1f MiB in %s",
            request.lora_name, request.lora_int_id, request.lora_path, num_bytes / 2**20, where,
        )

    def _modules(self) -> list[Any]:
        return [layer.get_submodule(name) for layer in self.layers.values() for name in {m for m, _ in PROJECTIONS.values()}]
