"""LLMEngine, the front end: an input processor, a core client and an output processor.

A request is tokenized and checked here (InputProcessor), sent to the engine core through its
client (in this process or its own, see engine/core/client.py), and each step's news comes back
to be detokenized, checked for stop strings and merged into user-facing outputs
(OutputProcessor). `LLM` and `AsyncLLM` both drive one of these.

Threads: add and abort may be called from any thread while one thread calls `step` (AsyncLLM's
output thread); one lock guards the output processor.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pagedserve.config import EngineConfig, WorkerPlacement
from pagedserve.engine.core.make_client import make_client
from pagedserve.engine.core.messages import AbortRequests, AddRequest, RemoveLoRA, StopRequests
from pagedserve.engine.engine_core_output import FinishReason, StepOutputs
from pagedserve.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagedserve.engine.metrics import EngineStats
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.request_output import RequestOutput
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The workers died and could not be rebuilt; the engine accepts no more work."""


class LLMEngine:
    def __init__(self, config: EngineConfig, placement: WorkerPlacement | None = None):
        """`placement`: the bundles of a Ray Serve replica's group for its workers (see create_executor)."""
        self.config = config
        self.engine_core = make_client(config, placement)
        self.model_config = self.engine_core.model_config
        self.num_kv_blocks = self.engine_core.num_kv_blocks
        self.tokenizer = load_tokenizer(self.model_config.tokenizer_path)
        self.input_processor = InputProcessor(self.tokenizer, config, self.model_config)
        self.stats = EngineStats()
        # Its own tokenizer instance: callers encode on their threads while step() decodes on
        # another, and one fast tokenizer used from two threads can fail ("Already borrowed").
        self.output_processor = OutputProcessor(load_tokenizer(self.model_config.tokenizer_path), self.stats)
        self.dead_reason: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- requests (any thread) ----------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def step_started(self) -> float | None:
        """time.monotonic() when the core's running step began; None between steps."""
        return self.engine_core.step_started

    @property
    def num_waiting_requests(self) -> int:
        """Engine requests (n per user request) waiting for a slot, those on their way included."""
        return self.engine_core.num_waiting_requests

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError (queueing nothing) on bad input."""
        processed = self.input_processor.process(prompt, params, lora_request=lora_request)
        self.add_processed_request(request_id, processed, params, arrival_time)

    # ---- LoRA adapters (vLLM's names) ---------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter and register it ahead of its requests (ValueError if it cannot be
        served); False if its id was already known."""
        return self.input_processor.loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its requests must name it again, by the same id and path). The
        workers drop its weights at the next step that no running request of it is in."""
        with self._lock:
            removed = self.input_processor.loras.remove(lora_int_id)
            if removed:
                self.engine_core.send(RemoveLoRA(lora_int_id))
        return removed

    def list_loras(self) -> set[int]:
        return self.input_processor.loras.list()

    def add_processed_request(
        self, request_id: str, processed: ProcessedPrompt, params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        """Queue a request that `input_processor.process` already validated (AsyncLLM validates
        in the caller's thread)."""
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        with self._lock:
            if self.is_dead:
                raise EngineDeadError(self.dead_reason)
            self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids, params, arrival_time, processed.resume)
            self.engine_core.send(AddRequest(request_id, processed, params, arrival_time))

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            child_ids = self.output_processor.abort_requests(ids)
            if child_ids:
                self.engine_core.send(AbortRequests(child_ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def stats_snapshot(self) -> EngineStats:
        """Counters and histograms so far, with the scheduler's gauges as of its latest step."""
        with self._lock:
            snapshot = self.stats.copy()
        gauges = self.engine_core.gauges
        for name in vars(gauges):
            setattr(snapshot, name, getattr(gauges, name))
        snapshot.num_lora_adapters = len(self.list_loras())
        return snapshot

    # ---- the step (one thread) ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Wait for the core's next step and return its outputs. Raises EngineDeadError when
        the core has gone."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        try:
            step = self.engine_core.get_output()
        except EOFError:
            with self._lock:
                self.dead_reason = self.dead_reason or self.engine_core.exit_reason()
            raise EngineDeadError(self.dead_reason) from None
        with self._lock:
            outputs = self._process(step.outputs)
            if step.dead_reason is not None:  # the core gave up its requests
                self.dead_reason = step.dead_reason
                outputs += self.output_processor.finish_aborted(list(self.output_processor.states))
        return outputs

    def _process(self, news: StepOutputs) -> list[RequestOutput]:
        """Under the lock. Requests the core gave up (refused, or its workers lost) end as
        aborted; the rest are detokenized, and those a stop string ended are stopped in the core.
        (Only a full EngineCoreOutput can say a request was given up, never a plain row.)"""
        given_up = [o.req_id for o in news.outputs if o.finish_reason == FinishReason.ABORT and not o.new_token_ids]
        outputs = self.output_processor.finish_aborted(given_up) if given_up else []
        if given_up:
            kept = [o for o in news.outputs if not (o.finish_reason == FinishReason.ABORT and not o.new_token_ids)]
            news = StepOutputs(kept, news.token_req_ids, news.token_ids)
        step_outputs, stopped = self.output_processor.process_outputs(news)
        if stopped:
            self.engine_core.send(StopRequests(stopped))
        return outputs + step_outputs

    def shutdown(self, timeout: float = 30.0) -> None:
        """The core finishes its running step (waited for at most `timeout`), releases its
        workers and stops. Idempotent."""
        if hasattr(self, "engine_core"):
            self.engine_core.shutdown(timeout)
