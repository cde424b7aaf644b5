"""Every knob of the engine as a pydantic field, and the shape of what it resolves to.

`EngineConfig` is what a user sets (keyword arguments of `LLM`, YAML keys and CLI flags map 1:1
onto its fields). `ModelConfig` is what the engine derives from it and the checkpoint's
`config.json` (model_resolver.resolve_model_config): both travel to the workers. This module only
describes: it reads no checkpoint, probes no device and starts nothing, so every layer may use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagedserve.cpu_list import parse_rank_cpu_lists

DEMO_MODEL = "demo"
MODEL_HELP = (
    "A local Hugging Face checkpoint folder, a .gguf file, a model hub id ('org/name'), "
    "'demo' (SmolLM2-135M-Instruct) or 'tiny' (a random-weight test model)."
)
# The CPU has no memory profiler to size the cache from; tests build many engines in one process.
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024**2
# The step's token budget unless max_num_batched_tokens says otherwise (EngineConfig.token_budget).
# Measured at saturation on the 2-core Zen 4: 1024 lost on throughput, TTFT and ITL alike
# (docs/benchmarks.md); vLLM's CPU server default is the same 2048.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class EngineConfig(BaseModel):
    """The engine's arguments (vLLM's names). Unknown names are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description=MODEL_HELP)
    tokenizer: str | None = Field(None, description="Tokenizer folder or hub id; defaults to the model's.")
    revision: str | None = Field(None, description="A hub model's branch, tag or commit (default: main).")
    dtype: Literal["auto", "float32", "float", "float16", "half", "bfloat16"] = "auto"
    seed: int = 0
    max_model_len: int | None = Field(None, ge=1)
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="Most tokens one step computes (prefill chunks and decodes together). Default: 2048, "
        "or max_model_len if larger when enable_chunked_prefill is off (a whole prompt must fit in one step).",
    )
    min_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="With chunked prefill, a step's budget while few requests run: each step may compute "
        "max(this, 16 x the running requests, the next waiting prompt beside a token per running request, "
        "sqrt(waiting prompt tokens x (16 + 2 x the running requests))) tokens, at most max_num_batched_tokens, so a "
        "few new prompts get their first tokens in turn rather than all at the end of one long step, a deep queue goes "
        "in a few prompts a step, and a long step comes only when many rows share it. None: every step "
        "max_num_batched_tokens. "
        "`pagedserve serve` on the CPU defaults to 128 (cluster/server_config.py says why).",
    )
    max_num_seqs: int = Field(
        256,
        ge=1,
        description="Most requests running at once (decode batch rows); `pagedserve serve` on the CPU defaults to 128 "
        "(cluster/server_config.py says why).",
    )
    schedule_conservativeness: float = Field(
        1.0,
        ge=0,
        allow_inf_nan=False,
        description="How much KV cache a waiting request leaves for the running ones (SGLang's name): it is admitted only "
        "if the free blocks also hold what each running request is expected to still write, its expected output being "
        "the mean output length of finished requests times this factor (at most its max_tokens). 0: admit whatever fits "
        "now, as vLLM does, and preempt the newest requests when the cache runs out; larger: fewer preemptions, smaller "
        "batches.",
    )
    num_gpu_blocks_override: int | None = Field(None, ge=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attention_backend: Literal["auto", "torch", "native", "cpu", "triton", "flash_attn"] = "auto"
    num_cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads of the process that runs the model on the CPU; default: what the "
        "process is allowed (Ray sets it from the actor's or replica's num_cpus).",
    )
    light_step_cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads for a light CPU step: at most 4 tokens, or decode only (one token per "
        "request); fewer than num_cpu_threads so that a server's other processes, whose work grows with the "
        "tokens streamed, get a core without stalling the model's threads; steps with prefill take every thread; "
        "default: the same as every other step. `pagedserve serve` sets it on a machine it has to itself.",
    )
    cpu_omp_threads_bind: str = Field(
        "auto",
        description="the CPUs the model's torch threads run on, one thread to one CPU (vLLM's VLLM_CPU_OMP_THREADS_BIND): "
        "'auto' binds them in the engine core process when its threads are every CPU it may use (as `pagedserve serve` "
        "sets up), so that a busy process beside the engine cannot make them share a core; 'nobind'; or a CPU list "
        "such as '0-3' naming one CPU per torch thread, bound wherever the model runs; with more than one rank "
        "(tensor or pipeline parallel), one list per rank in rank order, '|' between them, as vLLM writes it: '0-3|4-7'.",
    )
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    distributed_executor_backend: Literal["uni", "ray"] | None = None
    enforce_eager: bool | None = Field(
        None,
        description="True: run the model eagerly (no CUDA graphs, no torch.compile); False: also torch.compile the "
        "model on the CPU (TP size 1), at start-up, cached on disk; default (None): CUDA graphs on a GPU, eager on the CPU "
        "(compiling costs minutes on a small CPU for about 12% faster bf16 decode, measured).",
    )
    engine_core_process: bool = Field(
        False,
        description="Run the engine core (scheduler + executor) in its own process, as vLLM v1 does, while this "
        "process tokenizes, detokenizes and streams (AsyncLLM and LLM); False: one process (tests, debugging).",
    )
    max_logprobs: int = Field(20, ge=0, description="Largest `logprobs` a request may ask for.")
    max_worker_restarts: int = Field(
        3, ge=0, description="Times in a row a dead worker group is rebuilt before the engine gives up."
    )
    step_timeout_s: float = Field(300.0, gt=0, description="A step still running after this long means a wedged worker: the group is rebuilt as if it had died.")
    max_n: int = Field(128, ge=1, description="Largest `n` (samples per prompt) a request may ask for; over HTTP, prompts x n.")
    max_waiting_requests: int | None = Field(
        4096,
        ge=0,
        description="Engine requests (each of n samples counts) that may wait for a slot before AsyncLLM (the server) "
        "refuses more (HTTP 503 with Retry-After); None: no limit. Offline LLM.generate queues all its prompts.",
    )
    structured_outputs_backend: Literal["auto", "xgrammar", "guidance"] = Field(
        "auto",
        description="Grammar engine for structured outputs (json, regex, choice, grammar): xgrammar, llguidance "
        "('guidance'), or auto (xgrammar, and llguidance for a spec xgrammar does not support, such as a Lark grammar).",
    )
    structured_outputs_prewarm: bool = Field(
        False,
        description="Build the grammar backend (tokenizer and vocabulary tables) in the background at start, so the "
        "first constrained request does not wait for it; the server turns it on, offline engines build it on first use.",
    )
    structured_outputs_compile_timeout_s: float = Field(
        30.0, gt=0, description="A grammar still compiling after this long fails its request (too costly a spec)."
    )

    generation_config: str = Field(
        "auto",
        description="Sampling defaults of LLM.generate called without SamplingParams (vLLM's get_default_sampling_params): "
        "'auto' (the model folder's generation_config.json), 'vllm' (none: SamplingParams' own) or a folder holding one.",
    )
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None,
        description="A reasoning model's format: a constrained request's grammar applies only after its reasoning "
        "ends (</think>), as vLLM's --reasoning-parser does; the server sets it from its own reasoning_parser.",
    )
    enable_lora: bool = Field(False, description="Serve LoRA adapters (PEFT folders) on top of the base model, chosen per request.")
    max_loras: int = Field(1, ge=1, description="Adapters resident on the workers at once; at most this many distinct adapters run in one step.")
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank (r) accepted; the slots are sized for it.")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="Adapters kept loaded in host memory (LRU); default: max_loras. Must be >= max_loras."
    )

    @field_validator("cpu_omp_threads_bind")
    @classmethod
    def _auto_nobind_or_cpu_list(cls, value: str) -> str:
        if value not in ("auto", "nobind"):
            try:
                parse_rank_cpu_lists(value)
            except ValueError as error:
                raise ValueError(f"{error}; or one such list per rank, '|' between them; or 'auto', or 'nobind'") from None
        return value

    @field_validator("block_size")
    @classmethod
    def _block_size_is_power_of_two(cls, value: int) -> int:
        if value < 1 or value > 256 or value & (value - 1):
            raise ValueError("must be a power of two between 1 and 256")
        return value

    @model_validator(mode="after")
    def _least_budget_needs_chunking(self) -> EngineConfig:
        if self.min_num_batched_tokens is not None and not self.enable_chunked_prefill:
            raise ValueError(
                "min_num_batched_tokens needs enable_chunked_prefill: without chunking a prompt longer than a step's "
                "budget could not run; leave min_num_batched_tokens unset or enable chunked prefill"
            )
        if None not in (self.min_num_batched_tokens, self.max_num_batched_tokens) and self.min_num_batched_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"min_num_batched_tokens ({self.min_num_batched_tokens}) must be <= max_num_batched_tokens ({self.max_num_batched_tokens})"
            )
        return self

    @model_validator(mode="after")
    def _budget_fits_without_chunking(self) -> EngineConfig:
        budget, limit = self.max_num_batched_tokens, self.max_model_len
        if not self.enable_chunked_prefill and budget is not None and limit is not None:
            if budget < limit:
                raise ValueError(
                    f"max_num_batched_tokens ({budget}) must be >= max_model_len ({limit}) "
                    "when enable_chunked_prefill is False: a whole prompt must fit in one step"
                )
        return self

    @model_validator(mode="after")
    def _one_cpu_list_per_rank(self) -> EngineConfig:
        if self.cpu_omp_threads_bind in ("auto", "nobind"):
            return self
        lists = len(parse_rank_cpu_lists(self.cpu_omp_threads_bind))  # valid: the field's own check ran first
        if lists != self.world_size:
            raise ValueError(
                f"cpu_omp_threads_bind {self.cpu_omp_threads_bind!r} has {lists} CPU list(s) for tensor_parallel_size x "
                f"pipeline_parallel_size = {self.world_size} ranks: give each rank its own list in rank order, '|' between "
                "them ('0-3|4-7'; ranks on one machine need CPUs of their own), or 'auto', or 'nobind'"
            )
        return self

    @model_validator(mode="after")
    def _cpu_loras_hold_the_slots(self) -> EngineConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.enable_lora and self.enforce_eager is False:
            raise ValueError("enable_lora runs the model eagerly: leave enforce_eager unset or True (torch.compile is not combined with LoRA)")
        return self

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def token_budget(self, max_model_len: int) -> int:
        """The most tokens one step computes: max_num_batched_tokens, else DEFAULT_MAX_NUM_BATCHED_TOKENS
        with chunked prefill (a longer prompt runs in chunks), and at least the whole context without
        it (a prompt must fit in one step). Growing the budget with a long context, as it once did,
        made SmolLM2's default 8192-token steps, which a burst of prompts fills with prefill."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return DEFAULT_MAX_NUM_BATCHED_TOKENS
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)

    @property
    def executor_backend(self) -> str:
        """'uni' (one rank in this process) or 'ray' (worker actors); more than one rank needs Ray."""
        return self.distributed_executor_backend or ("ray" if self.world_size > 1 else "uni")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, turning pydantic's report into one readable ValueError."""
        try:
            return cls(**kwargs)
        except ValidationError as error:
            raise ValueError(describe_validation_error(error, "engine argument")) from None


def describe_validation_error(error: ValidationError | list[dict[str, Any]], what: str) -> str:
    """One line per problem: the field, the value given, and what is allowed. `error`: pydantic's
    error, or its `errors()` list (the HTTP ingress passes FastAPI's, with the "body" prefix
    already stripped from each location)."""
    lines = []
    for item in error.errors() if isinstance(error, ValidationError) else error:
        name = ".".join(str(part) for part in item["loc"]) or "(config)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            lines.append(f"unknown {what} '{name}'")
        elif not item["loc"]:  # a whole-model check: its message names what is wrong
            lines.append(message)
        else:
            given = f" (got {_short_repr(item['input'])})" if "input" in item else ""
            lines.append(f"{what} '{name}'{given}: {message}")
    return "; ".join(lines)


def _short_repr(value: Any, limit: int = 60) -> str:
    """A value as given, cut short: an error message must not echo a megabyte back."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class ModelConfig:
    """What the engine and the workers derive from `EngineConfig` and the checkpoint."""

    model_path: str
    tokenizer_path: str
    architecture: str
    # config.json as resolved by transformers, as a plain namespace: it travels to every worker,
    # and unpickling a transformers config class would cost each worker seconds of imports.
    hf_config: SimpleNamespace
    dtype: torch.dtype
    device: str  # "cpu" or "cuda"
    max_model_len: int
    vocab_size: int  # rows of the embedding; may exceed the tokenizer's size (padding)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]  # every id that ends a request unless ignore_eos


@dataclass(frozen=True)
class WorkerPlacement:
    """Where an engine's ranks go in a placement group made by someone else (a Serve replica's):
    rank i in bundle `bundle_indices[i]`. Whoever makes the group decides its layout (cluster/app.py);
    the executor takes the indices it is given."""

    placement_group: Any  # a ray.util.placement_group.PlacementGroup
    bundle_indices: tuple[int, ...]


def default_cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pagedserve"
