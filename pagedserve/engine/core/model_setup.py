"""The ModelConfig the engine core runs with: resolved from the engine config (the executor picks
the device), with the tokenizer's EOS, and its max_model_len capped to what the KV cache holds."""

from __future__ import annotations

import dataclasses
import logging

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.executor.factory import executor_class
from pagedserve.model_resolver import resolve_model_config

logger = logging.getLogger(__name__)


def resolve_core_model_config(config: EngineConfig) -> ModelConfig:
    """The executor picks the device: only it knows where the ranks run (the Ray one starts or
    joins Ray, with a CPU slot per rank, to ask). The tokenizer is loaded only to read its EOS:
    the core keeps none."""
    model_config = resolve_model_config(config, executor_class(config).resolve_device)
    return with_tokenizer_eos(model_config, load_tokenizer(model_config.tokenizer_path))


def with_tokenizer_eos(model_config: ModelConfig, tokenizer) -> ModelConfig:
    """The tokenizer's EOS ends requests too, even when config.json does not name it."""
    eos = tokenizer.eos_token_id
    if eos is None or eos in model_config.eos_token_ids:
        return model_config
    return dataclasses.replace(model_config, eos_token_ids=(*model_config.eos_token_ids, eos))


def fit_max_model_len(model_config: ModelConfig, requested: int | None, kv_capacity: int) -> ModelConfig:
    """A request must fit in the KV cache whole. A model's own limit (SmolLM2 says 8192) may be
    more than a CPU cache holds: capped, as vLLM does; a limit the user asked for is an error."""
    if model_config.max_model_len <= kv_capacity:
        return model_config
    if requested is not None:
        raise ValueError(
            f"max_model_len={requested} is more than the KV cache holds ({kv_capacity} tokens); lower "
            "max_model_len or give the cache more memory (kv_cache_memory_bytes, gpu_memory_utilization)"
        )
    logger.warning(
        "max_model_len capped from %d (the model's limit) to %d, what the KV cache holds",
        model_config.max_model_len, kv_capacity,
    )
    return dataclasses.replace(model_config, max_model_len=kv_capacity)
