"""pagedserve: a distributed LLM inference server on Ray (paged KV caches, continuous batching).

`from pagedserve import LLM, SamplingParams`. Names load lazily, so a worker process that
imports a submodule does not pay for the whole engine.
"""

from typing import TYPE_CHECKING

from pagedserve.onednn_caches import bound_caches

__version__ = "0.1.0"

bound_caches()  # before any model runs in this process (onednn_caches.py)

_EXPORTS = {
    "LLM": "pagedserve.engine.llm",
    "LLMEngine": "pagedserve.engine.llm_engine",
    "AsyncLLM": "pagedserve.engine.async_llm",
    "EngineConfig": "pagedserve.config",
    "SamplingParams": "pagedserve.sampling_params",
    "RequestOutputKind": "pagedserve.sampling_params",
    "StructuredOutputsParams": "pagedserve.sampling_params",
    "RequestOutput": "pagedserve.engine.request_output",
    "CompletionOutput": "pagedserve.engine.request_output",
    "Logprob": "pagedserve.engine.request_output",
    "TextPrompt": "pagedserve.inputs",
    "TokensPrompt": "pagedserve.inputs",
    "LoRARequest": "pagedserve.lora_request",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.engine.request_output import CompletionOutput, Logprob, RequestOutput
    from pagedserve.inputs import TextPrompt, TokensPrompt
    from pagedserve.lora_request import LoRARequest
    from pagedserve.sampling_params import (
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
