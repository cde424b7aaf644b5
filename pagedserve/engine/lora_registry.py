"""The front end's LoRA adapters (vLLM's add_lora / remove_lora / list_loras): each lora_int_id is
checked once where a request or `add_lora` first names it (its PEFT folder read and held to what
the engine serves, errors naming the field) and stays bound to its path, so an id can never mean
two adapters. The workers load an adapter from its path when a step first brings it."""

from __future__ import annotations

import threading

from pagedserve.config import EngineConfig
from pagedserve.lora_request import LoRARequest
from pagedserve.workers.lora.peft_adapter import check_adapter


class LoRARegistry:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.adapters: dict[int, LoRARequest] = {}
        # Removed adapters' paths: workers may still hold their weights under the id, so an id
        # never comes back for another folder.
        self.retired: dict[int, str] = {}
        self._lock = threading.Lock()  # (AsyncLLM checks requests in its callers' threads)

    def check(self, request: LoRARequest | None) -> LoRARequest | None:
        """The request's adapter, checked; ValueError when the engine cannot serve it."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if not self.config.enable_lora:
            raise ValueError("lora_request needs an engine started with enable_lora=True")
        with self._lock:
            known = self.adapters.get(request.lora_int_id)
            retired = self.retired.get(request.lora_int_id)
            if retired is not None and retired != request.lora_path:
                raise ValueError(f"lora_int_id {request.lora_int_id} was an adapter at {retired}; an id is never reused for another adapter")
            if known is None:
                check_adapter(request.lora_path, self.config.max_lora_rank)
                self.adapters[request.lora_int_id] = request
            elif known.lora_path != request.lora_path:
                raise ValueError(
                    f"lora_int_id {request.lora_int_id} is already adapter {known.lora_name!r} at {known.lora_path}; "
                    f"give {request.lora_name!r} an id of its own"
                )
        return request

    def add(self, request: LoRARequest) -> bool:
        """Check and register an adapter ahead of its requests; False if its id was known."""
        is_new = request.lora_int_id not in self.adapters
        self.check(request)
        return is_new

    def remove(self, lora_int_id: int) -> bool:
        with self._lock:
            removed = self.adapters.pop(lora_int_id, None)
            if removed is not None:
                self.retired[lora_int_id] = removed.lora_path
            return removed is not None

    def list(self) -> set[int]:
        return set(self.adapters)
