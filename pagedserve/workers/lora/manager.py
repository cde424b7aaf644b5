"""The adapters one rank holds: loaded from their PEFT folders the first time a step brings a
request of theirs (each rank reads its own shard), kept by recency, at most
`max(max_loras, max_cpu_loras)`; the scheduler puts at most `max_loras` distinct adapters in one
step, so the adapters of the step in hand are never the ones evicted.

The weights live beside each linear layer (`layer.lora_weights`, layer_lora.py). On the CPU the
resident adapters are the host cache; a GPU would keep `max_loras` of them in device slots and
the rest in host memory (not built: the CPU is what this project serves on today)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch

from pagedserve.lora_request import LoRARequest
from pagedserve.workers.lora.layer_lora import shard_for_layer
from pagedserve.workers.lora.peft_adapter import check_adapter, read_adapter

logger = logging.getLogger(__name__)

# adapter projection -> (the module of our decoder layer it adapts, the base loader's shard id)
PROJECTIONS = {
    "q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"), "v_proj": ("self_attn.qkv_proj", "v"),
    "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", None),
}


class WorkerLoRAManager:
    def __init__(self, model: Any, max_lora_rank: int, capacity: int, dtype: torch.dtype, device: torch.device):
        self.layers = model.model.layers  # this stage's decoder layers, by index (a string)
        self.max_lora_rank = max_lora_rank
        self.capacity = capacity
        self.dtype, self.device = dtype, device
        # Adapters are held in float32 on the CPU, whatever the model's dtype (layer_lora.py's
        # low_rank_product: faster at decode sizes); a GPU keeps the model's dtype.
        self.lora_dtype = torch.float32 if device.type == "cpu" else dtype
        self.resident: OrderedDict[int, str] = OrderedDict()  # lora_int_id -> its path, oldest first

    def ensure(self, requests: list[LoRARequest], in_use: set[int]) -> None:
        """Load the adapters of `requests` not yet resident, evicting the least recent ones not
        `in_use` (the step's) beyond the capacity."""
        for request in requests:
            if request.lora_int_id in self.resident:
                self.resident.move_to_end(request.lora_int_id)
                continue
            self._load(request)
        for lora_id in list(self.resident):
            if len(self.resident) <= self.capacity:
                break
            if lora_id not in in_use:
                self.remove(lora_id)

    def remove(self, lora_id: int) -> bool:
        if self.resident.pop(lora_id, None) is None:
            return False
        for module in self._modules():
            module.lora_weights.pop(lora_id, None)
        return True

    def _load(self, request: LoRARequest) -> None:
        weights = read_adapter(check_adapter(request.lora_path, self.max_lora_rank))
        by_module: dict[tuple[str, str], dict[Any, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer_index, projection), pair in weights.items():
            module_name, shard_id = PROJECTIONS[projection]
            by_module.setdefault((str(layer_index), module_name), {})[shard_id] = pair
        num_bytes = 0
        for (layer_index, module_name), parts in by_module.items():
            if layer_index not in self.layers:
                continue  # another pipeline stage's layer
            module = self.layers[layer_index].get_submodule(module_name)
            a, b = (t.to(self.device, self.lora_dtype) for t in shard_for_layer(module, parts))
            module.lora_weights[request.lora_int_id] = (a, b)
            num_bytes += a.nbytes + b.nbytes
        self.resident[request.lora_int_id] = request.lora_path
        logger.info(
            "loaded LoRA adapter %s (id %d) from %s: %.1f MiB resident on this rank",
            request.lora_name, request.lora_int_id, request.lora_path, num_bytes / 2**20,
        )

    def _modules(self) -> list[Any]:
        return [layer.get_submodule(name) for layer in self.layers.values() for name in {m for m, _ in PROJECTIONS.values()}]
