"""The engine core: an LLMEngine whose step hands back the scheduler's per-request news
(EngineCoreOutput) instead of user-facing outputs, and the busy loop that runs it in the core
process: take every waiting message, step, send the step's news, repeat; block only when idle.

Detokenization, stop strings and the n-completions merge happen in the front end. A stop string
found there comes back as StopRequests, one step late: the core may have computed one more token
of that request, which the front end drops (it no longer knows the id).
"""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection
from typing import Any

from pagedserve.engine.core import messages
from pagedserve.engine.core.messages import (
    AbortRequests,
    AddRequest,
    CoreOutputs,
    SchedulerGauges,
    ShutdownCore,
    StopRequests,
)
from pagedserve.engine.core.step_clock import StepClock
from pagedserve.engine.engine_core_output import EngineCoreOutput, FinishReason
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.output_processor import child_request_id
from pagedserve.engine.core.request import RequestStatus
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class CoreOutputCollector:
    """Stands in for the OutputProcessor inside the core: it keeps which children belong to
    which user request (for aborts), and passes the scheduler's news through untouched."""

    def __init__(self) -> None:
        self.children: dict[str, list[str]] = {}  # user request id -> its children's ids
        self.parent_of: dict[str, str] = {}  # child id -> user request id

    def add_request(
        self, request_id: str, prompt: Any, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float, resume: Any = None
    ) -> list[tuple[str, SamplingParams]]:
        """The same children (ids and params) as OutputProcessor.add_request makes (a resume's
        text state lives in the front end's output processor)."""
        if request_id in self.children:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            children = [(request_id, params)]
        else:
            children = [(child_request_id(request_id, i), params.for_child(i)) for i in range(params.n)]
        self.children[request_id] = [child_id for child_id, _ in children]
        self.parent_of.update((child_id, request_id) for child_id, _ in children)
        return children

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        child_ids = []
        for request_id in request_ids:
            for child_id in self.children.pop(request_id, []):
                if self.parent_of.pop(child_id, None) is not None:
                    child_ids.append(child_id)
        return child_ids

    def forget(self, child_ids: list[str]) -> None:
        for child_id in child_ids:
            request_id = self.parent_of.pop(child_id, None)
            siblings = self.children.get(request_id)
            if siblings is not None and not any(c in self.parent_of for c in siblings):
                del self.children[request_id]

    def finish_aborted(self, child_ids: list[str]) -> list[EngineCoreOutput]:
        """The engine gave these up: the front end ends them with finish_reason "abort"."""
        self.forget(child_ids)
        return [EngineCoreOutput(child_id, [], finish_reason=FinishReason.ABORT) for child_id in child_ids]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[EngineCoreOutput], list[str]]:
        """The step's news as it is; no stop strings here (the front end sends StopRequests)."""
        self.forget([o.req_id for o in outputs if o.finish_reason is not None])
        return outputs, []


class EngineCore:
    """The core's engine and its message handling (one thread: no locks)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.collector = CoreOutputCollector()
        engine.output_processor = self.collector
        self.num_added_children = 0
        self.pending_failures: list[EngineCoreOutput] = []  # adds the core refused, to report
        # A message changed the scheduler since the last step was sent: before going idle, the
        # core sends its gauges once more (an abort of the last request must show as 0 running).
        self.is_report_due = False

    def handle(self, message: Any) -> None:
        self.is_report_due = True
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            self.engine.abort_request(message.request_ids)
        elif isinstance(message, StopRequests):
            self.collector.forget(message.child_ids)
            self.engine.scheduler.finish_requests(message.child_ids, RequestStatus.FINISHED_STOPPED)
        else:
            raise TypeError(f"the engine core got an unknown message: {type(message).__name__}")

    def _add(self, message: AddRequest) -> None:
        self.num_added_children += message.params.n
        try:
            self.engine.add_processed_request(message.request_id, message.processed, message.params, message.arrival_time)
        except Exception:  # the front end validated it; if the core still cannot take it, end it alone
            logger.exception("the engine core could not add request %r", message.request_id)
            child_ids = self.collector.abort_requests([message.request_id]) or [message.request_id]
            self.pending_failures.extend(EngineCoreOutput(c, [], finish_reason=FinishReason.ABORT) for c in child_ids)

    def step(self) -> CoreOutputs:
        outputs = self.pending_failures + self.engine.step()
        self.pending_failures = []
        self.is_report_due = False
        return CoreOutputs(outputs, self.gauges(), self.num_added_children, self.engine.dead_reason)

    def gauges(self) -> SchedulerGauges:
        scheduler, kv = self.engine.scheduler, self.engine.kv_cache_manager
        return SchedulerGauges(
            scheduler.num_running, scheduler.num_waiting, kv.usage, scheduler.num_preemptions_total,
            kv.num_prefix_queries, kv.num_prefix_hits,
        )

    def run(self, conn: Connection, clock: StepClock) -> None:
        """The busy loop. Returns on ShutdownCore, when the front end's end closes, or once the
        engine died (after sending the step that says so)."""
        while self._take_messages(conn):
            if not self._has_work():
                continue
            clock.start(time.monotonic())
            try:
                step = self.step()
            finally:
                clock.stop()
            messages.send(conn, step)
            if step.dead_reason is not None:
                return

    def _take_messages(self, conn: Connection) -> bool:
        """Handle every message waiting; with no work, block until one comes. False: leave."""
        try:
            while True:
                if not self._has_work() and self.is_report_due:
                    self.is_report_due = False
                    messages.send(conn, CoreOutputs([], self.gauges(), self.num_added_children))
                if not conn.poll(0 if self._has_work() else None):
                    return True
                message = messages.recv(conn)
                if isinstance(message, ShutdownCore):
                    return False
                self.handle(message)
        except (EOFError, OSError):  # the front end is gone
            return False

    def _has_work(self) -> bool:
        return bool(self.pending_failures) or self.engine.has_unfinished_requests()
