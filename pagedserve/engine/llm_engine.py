"""The synchronous engine: add requests, step, read outputs.

A step is: schedule -> execute on the workers -> update the scheduler -> detokenize and build
outputs. The engine reaches the model only through its `Executor`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from pagedserve.config import EngineConfig, ModelConfig, WorkerPlacement
from pagedserve.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.metrics import EngineStats
from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.request_output import RequestOutput
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.model_resolver import resolve_model_config
from pagedserve.sampling_params import SamplingParams
from pagedserve.executor.executor import WorkerGroupError
from pagedserve.executor.factory import create_executor, executor_class

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The workers died and could not be rebuilt; the engine accepts no more work."""


class LLMEngine:
    def __init__(self, config: EngineConfig, placement: WorkerPlacement | None = None):
        """`placement`: the bundles of a Ray Serve replica's group for its workers (see create_executor)."""
        self.config = config
        self.placement = placement
        # The executor picks the device: only it knows where the ranks run (the Ray one starts
        # or joins Ray, with a CPU slot per rank, to ask).
        model_config = resolve_model_config(config, executor_class(config).resolve_device)
        self.tokenizer = load_tokenizer(model_config.tokenizer_path)
        self.model_config = _with_tokenizer_eos(model_config, self.tokenizer)
        self.executor = create_executor(config, self.model_config, placement)
        try:
            num_blocks = self._initialize_kv_cache()
            self.model_config = _fit_max_model_len(self.model_config, config.max_model_len, num_blocks * config.block_size)
        except BaseException:
            self.executor.shutdown()
            raise
        self.num_kv_blocks = num_blocks
        self.num_worker_restarts = 0
        self._consecutive_failures = 0
        self.dead_reason: str | None = None
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_batched_tokens=config.max_num_batched_tokens or self.model_config.max_num_batched_tokens_default,
            max_num_seqs=config.max_num_seqs,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.input_processor = InputProcessor(self.tokenizer, config, self.model_config)
        self.stats = EngineStats()
        # Its own tokenizer instance: under AsyncLLM the output side decodes on the loop thread
        # while callers encode on theirs, and one fast tokenizer used from two threads can fail
        # ("Already borrowed": encoding may reconfigure it mutably).
        self.output_processor = OutputProcessor(load_tokenizer(self.model_config.tokenizer_path), self.stats)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    def _initialize_kv_cache(self) -> int:
        num_blocks = self.executor.determine_num_kv_blocks()
        if num_blocks < 1:
            raise ValueError(
                "the KV cache holds no block: give it more memory (kv_cache_memory_bytes, "
                "gpu_memory_utilization) or set num_gpu_blocks_override"
            )
        # The engine's block pool and the workers' caches must agree on the count.
        self.executor.initialize_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens", num_blocks, self.config.block_size)
        return num_blocks

    # ---- requests -------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None) -> None:
        """Validate and queue a request; raises ValueError (queueing nothing) on bad input."""
        self.add_processed_request(request_id, self.input_processor.process(prompt, params), params, arrival_time)

    def add_processed_request(
        self, request_id: str, processed: ProcessedPrompt, params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        """Queue a request that `input_processor.process` already validated (AsyncLLM validates
        in the caller's thread, then hands it to the engine loop)."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        resume = processed.resume
        children = self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids, params, arrival_time, resume)
        for child_id, child_params in children:
            request = Request(
                child_id, processed.prompt_token_ids, child_params, self.eos_token_ids, self.model_config.max_model_len, arrival_time,
                resume.output_token_ids if resume is not None else (),
            )
            self.scheduler.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        child_ids = self.output_processor.abort_requests(ids)
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_waiting_requests(self) -> int:
        return self.scheduler.num_waiting

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def stats_snapshot(self) -> EngineStats:
        """Counters and histograms so far, with the scheduler's gauges as of now."""
        snapshot = self.stats.copy()
        snapshot.num_requests_running = self.scheduler.num_running
        snapshot.num_requests_waiting = self.scheduler.num_waiting
        snapshot.kv_cache_usage_perc = self.kv_cache_manager.usage
        snapshot.num_preemptions_total = self.scheduler.num_preemptions_total
        snapshot.prefix_cache_queries_total = self.kv_cache_manager.num_prefix_queries
        snapshot.prefix_cache_hits_total = self.kv_cache_manager.num_prefix_hits
        return snapshot

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        scheduler_output = self.scheduler.schedule()
        runner_output = ModelRunnerOutput.empty()
        # An idle step still runs when requests ended, so the workers drop their state.
        if scheduler_output.total_num_scheduled_tokens or scheduler_output.dropped_req_ids:
            try:
                runner_output = self.executor.execute_model(scheduler_output)
                self._consecutive_failures = 0
            except WorkerGroupError as error:
                # The step never happened: nothing of it reached the scheduler's request state.
                return self._recover_from_worker_failure(error)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        request_outputs, stopped = self.output_processor.process_outputs(core_outputs)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return request_outputs

    # ---- recovery ---------------------------------------------------------------------------

    def _recover_from_worker_failure(self, error: WorkerGroupError) -> list[RequestOutput]:
        """Rebuild the worker group and requeue every in-flight request to recompute from its
        tokens (the same mechanism as preemption). Gives up after `max_worker_restarts`
        failures in a row: then every pending request ends with finish_reason "abort"."""
        logger.warning("worker group failed, rebuilding it: %s", error)
        self.executor.shutdown()
        self.scheduler.requeue_after_worker_loss()
        self._consecutive_failures += 1
        if self._consecutive_failures > self.config.max_worker_restarts:
            return self._die(f"the worker group failed {self._consecutive_failures} times in a row; last error: {error}")
        try:
            executor = create_executor(self.config, self.model_config, self.placement)
        except Exception as rebuild_error:
            return self._die(f"the worker group died ({error}) and could not be rebuilt: {rebuild_error}")
        self.executor = executor
        try:
            if executor.determine_num_kv_blocks() < self.num_kv_blocks:
                raise RuntimeError(f"the new workers hold fewer than {self.num_kv_blocks} KV blocks")
            executor.initialize_kv_cache(self.num_kv_blocks)
        except Exception as rebuild_error:
            return self._die(f"the worker group died ({error}) and could not be rebuilt: {rebuild_error}")
        self.num_worker_restarts += 1
        return []

    def _die(self, reason: str) -> list[RequestOutput]:
        logger.error("engine is dead: %s", reason)
        self.dead_reason = reason
        if self.executor is not None:
            self.executor.shutdown()
        child_ids = self.scheduler.unfinished_request_ids()
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.finish_aborted(child_ids)

    def shutdown(self) -> None:
        executor, self.executor = getattr(self, "executor", None), None
        if executor is not None:
            executor.shutdown()


def _fit_max_model_len(model_config: ModelConfig, requested: int | None, kv_capacity: int) -> ModelConfig:
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


def _with_tokenizer_eos(model_config: ModelConfig, tokenizer: Any) -> ModelConfig:
    """The tokenizer's EOS ends requests too, even when config.json does not name it."""
    eos = tokenizer.eos_token_id
    if eos is None or eos in model_config.eos_token_ids:
        return model_config
    return dataclasses.replace(model_config, eos_token_ids=(*model_config.eos_token_ids, eos))
