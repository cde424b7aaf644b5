"""A request's LoRA adapter, named as vLLM names it (`vllm.lora.request.LoRARequest`).

A module of the bottom layer: the offline API, the engine, the scheduler (which counts distinct
adapters per step and salts the prefix hash with `lora_int_id`) and the server all carry it, and
only plain data crosses to the workers.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LORA_NAME_CHARS = 256


@dataclass(frozen=True)
class LoRARequest:
    """One adapter: `lora_name` is what a client names it (the `model` of an HTTP request),
    `lora_int_id` (>= 1) identifies it in the engine (0 is the base model), `lora_path` is a
    PEFT folder (`adapter_config.json` + `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not 0 < len(self.lora_name) <= MAX_LORA_NAME_CHARS:
            raise ValueError(f"lora_name must be a non-empty string of at most {MAX_LORA_NAME_CHARS} characters")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string (a PEFT adapter folder), got {type(self.lora_path).__name__}")
