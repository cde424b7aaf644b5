"""ProcEngine: LLMEngine's interface (add, abort, step, stats) over an engine core that runs in
its own process. This process keeps the front end's half: tokenization and checks
(InputProcessor) and detokenization, stop strings and n-completions (OutputProcessor).

`step()` waits for the core's next step and turns its news into RequestOutputs while the core
already runs the step after; add and abort may be called from other threads meanwhile (one
lock guards the output processor).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from pagedserve.config import EngineConfig, WorkerPlacement
from pagedserve.engine.core.client import EngineCoreClient
from pagedserve.engine.core.messages import AbortRequests, AddRequest, SchedulerGauges, StopRequests
from pagedserve.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagedserve.engine.llm_engine import EngineDeadError
from pagedserve.engine.metrics import EngineStats
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.request_output import RequestOutput
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.sampling_params import SamplingParams


class ProcEngine:
    def __init__(self, config: EngineConfig, placement: WorkerPlacement | None = None):
        self.config = config
        self.core = EngineCoreClient(config, placement)
        self.model_config = self.core.model_config
        self.num_kv_blocks = self.core.num_kv_blocks
        self.tokenizer = load_tokenizer(self.model_config.tokenizer_path)
        self.input_processor = InputProcessor(self.tokenizer, config, self.model_config)
        self.stats = EngineStats()
        # Its own tokenizer instance, as in LLMEngine: callers encode on their threads while
        # step() decodes on another, and one fast tokenizer used from two threads can fail.
        self.output_processor = OutputProcessor(load_tokenizer(self.model_config.tokenizer_path), self.stats)
        self.dead_reason: str | None = None
        self._lock = threading.Lock()
        self._gauges = SchedulerGauges()
        self._num_sent_children = 0  # children of every AddRequest sent
        self._num_core_children = 0  # of those, the ones the core had taken in at its last step

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> ProcEngine:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- requests (any thread) ----------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def step_started(self) -> float | None:
        """time.monotonic() when the core's running step began; None between steps."""
        return self.core.clock.started

    @property
    def num_waiting_requests(self) -> int:
        """Engine requests waiting for a slot: the core's waiting queue, and those on their way."""
        return self._gauges.num_requests_waiting + self._num_sent_children - self._num_core_children

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None) -> None:
        self.add_processed_request(request_id, self.input_processor.process(prompt, params), params, arrival_time)

    def add_processed_request(self, request_id: str, processed: ProcessedPrompt, params: SamplingParams, arrival_time: float | None = None) -> None:
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        with self._lock:
            if self.is_dead:
                raise EngineDeadError(self.dead_reason)
            self.output_processor.add_request(request_id, processed.prompt, processed.prompt_token_ids, params, arrival_time, processed.resume)
            self._num_sent_children += params.n
            self.core.send(AddRequest(request_id, processed, params, arrival_time))

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            if self.output_processor.abort_requests(ids):
                self.core.send(AbortRequests(ids))

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.parents)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def stats_snapshot(self) -> EngineStats:
        with self._lock:
            snapshot = self.stats.copy()
        gauges = self._gauges
        for name in vars(gauges):
            setattr(snapshot, name, getattr(gauges, name))
        return snapshot

    # ---- the step (one thread) ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Wait for the core's next step and return its outputs. Raises EngineDeadError when
        the core process has gone."""
        if self.is_dead:
            raise EngineDeadError(self.dead_reason)
        try:
            step = self.core.recv()
        except EOFError:
            with self._lock:
                self.dead_reason = self.dead_reason or self.core.exit_reason()
            raise EngineDeadError(self.dead_reason) from None
        with self._lock:
            self._gauges = step.gauges
            self._num_core_children = step.num_added_children
            outputs, stopped = self.output_processor.process_outputs(step.outputs)
            if stopped:
                self.core.send(StopRequests(stopped))
            if step.dead_reason is not None:  # the core gave up its requests and exits
                self.dead_reason = step.dead_reason
                outputs += self.output_processor.finish_aborted(list(self.output_processor.states))
        return outputs

    def shutdown(self, timeout: float = 30.0) -> None:
        """The core leaves its step, releases its workers and exits (killed after `timeout`)."""
        if hasattr(self, "core"):
            self.core.shutdown(timeout)
