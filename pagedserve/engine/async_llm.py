"""AsyncLLM: the engine behind asyncio callers, streaming each request's outputs.

Callers validate their input in their own thread and hand the request to the LLMEngine at once
(its core client never makes them wait for a step). One output thread runs the engine's steps:
each waits for the core's next step (in this process or its own, EngineConfig.engine_core_process)
and turns its news into outputs (detokenizing, stop strings), which reach each request's caller
through an asyncio queue on the caller's loop. With nothing to do, the core's client sleeps: an
idle engine uses no CPU.

An error inside the loop (or an engine that died because its workers could not be rebuilt) is
delivered to every waiting caller; `is_healthy` turns false for health checks.

The output thread also builds the engine. With the core in this process, the thread that loads
the model and the thread that steps it must be one: the CPU's parallel ops run on an OpenMP team
per calling thread, and once a process holds two teams on a small machine (more threads than
cores), GNU OpenMP stops spinning between ops, so every op of a step waits to wake its team. A
128-token SmolLM2 prefill took 102-112 ms stepped on a thread other than the one that loaded it,
against 76-77 ms on that one (2-core Zen 4, bf16; docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from pagedserve.config import EngineConfig, WorkerPlacement
from pagedserve.engine.input_processor import PromptType, ResumeState
from pagedserve.engine.llm_engine import EngineDeadError, LLMEngine
from pagedserve.engine.metrics import EngineStats
from pagedserve.engine.request_output import RequestOutput
from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.2
SHUTDOWN_REASON = "the engine is shutting down"


class EngineOverloadedError(RuntimeError):
    """More engine requests wait for a slot than `max_waiting_requests` allows: retry later."""


@dataclass
class _Stream:
    """One request's outputs on their way to its caller, bounded: whatever the caller has not
    read yet is folded into one pending item (DELTA outputs merge; a CUMULATIVE or final output
    replaces the one before), so a caller that stops reading holds one output, not one per step.
    `put` is called from the loop thread; the folding runs on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    kind: RequestOutputKind
    pending: deque = field(default_factory=deque)  # at most a RequestOutput, then an error
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self._fold, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    def _fold(self, item: RequestOutput | BaseException) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BaseException):
            return  # the stream already ended with an error
        if isinstance(item, RequestOutput) and last is not None:
            if self.kind == RequestOutputKind.DELTA:
                last.merge_delta(item)
            else:
                self.pending[-1] = item
        else:
            self.pending.append(item)
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self.pending:
            self.ready.clear()
            await self.ready.wait()
        return self.pending.popleft()


def _fold_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, output in items:
        stream._fold(output)


class AsyncLLM:
    def __init__(self, config: EngineConfig, placement: WorkerPlacement | None = None):
        """`placement`: the bundles of a Ray Serve replica's group for the workers (see create_executor).
        The output thread builds the engine (module doc); its errors are raised here."""
        self.config = config
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._stats_time = 0.0
        self._stats_idle = True  # the snapshot shows an idle engine: the next busy step replaces it
        build_error: list[BaseException] = []
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(placement, built, build_error), name="pagedserve-engine-loop", daemon=True)
        self._thread.start()
        built.wait()
        if build_error:
            raise build_error[0]

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> AsyncLLM:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- callers' side -------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine cannot serve (None while it can): an error, shutdown, a dead worker
        group, or a step that has run longer than `step_timeout_s` (a wedged worker)."""
        if self._error is not None:
            return str(self._error)
        if self._stopping:
            return SHUTDOWN_REASON
        started = self.engine.step_started
        if started is not None and time.monotonic() - started > self.config.step_timeout_s:
            return f"an engine step has been running for {time.monotonic() - started:.0f} s (step_timeout_s={self.config.step_timeout_s:g})"
        return self.engine.dead_reason or (None if self._thread.is_alive() else "the engine loop has stopped")

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, resume: ResumeState | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes. Bad input raises ValueError before the
        first output; a full waiting queue raises EngineOverloadedError; a dead or stopping
        engine raises EngineDeadError (also mid-stream). Leaving the iteration early (a client
        that went away) aborts the request."""
        self._raise_if_dead()
        processed = self.engine.input_processor.process(prompt, sampling_params, resume, lora_request)  # resume: see ResumeState
        stream = _Stream(asyncio.get_running_loop(), sampling_params.output_kind)
        with self._lock:
            self._raise_if_dead()  # the loop died or shutdown began after the check above
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._admit(sampling_params.n)
            self._streams[request_id] = stream
            try:
                self.engine.add_processed_request(request_id, processed, sampling_params, time.monotonic())
            except BaseException:
                self._streams.pop(request_id, None)
                raise
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            if not self._stopping:
                self.engine.abort_request(request_id)

    def shutdown(self, timeout: float = 30.0) -> None:
        """End every open stream with EngineDeadError at once (later calls fail at once too);
        the core finishes its running step, then releases the workers. A step still running
        after `timeout` (wedged) does not hold the shutdown up forever."""
        with self._lock:
            self._stopping = True
        self._end_streams(EngineDeadError(SHUTDOWN_REASON))
        self.engine.shutdown(timeout)  # the output thread's wait for the next step then ends
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- LoRA adapters (vLLM's names; checked and registered in the front end) -----------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    async def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def stats(self) -> EngineStats:
        """The engine's latest statistics (at most STATS_INTERVAL_S old while it is busy), with
        its adapters counted now: an idle engine's snapshot waits for its next step."""
        return dataclasses.replace(self._stats, num_lora_adapters=len(self.engine.list_loras()))

    def _raise_if_dead(self) -> None:
        reason = self.dead_reason
        if reason is not None:
            raise self._error if isinstance(self._error, EngineDeadError) else EngineDeadError(reason)

    def _admit(self, num_children: int) -> None:
        """Admission control (under the lock), counted in engine requests, n samples each."""
        limit = self.config.max_waiting_requests
        if limit is None:
            return
        num_waiting = self.engine.num_waiting_requests
        if num_waiting + num_children > limit:
            raise EngineOverloadedError(
                f"the server is overloaded: {num_waiting} requests wait for the engine (max_waiting_requests={limit}); retry later"
            )

    # ---- the loop thread -------------------------------------------------------------------

    def _run(self, placement: WorkerPlacement | None, built: threading.Event, build_error: list[BaseException]) -> None:
        """The output thread: builds the engine, then runs each of the core's steps in turn, until
        shutdown."""
        try:
            self.engine = LLMEngine(self.config, placement)
            self._stats = self.engine.stats_snapshot()  # refreshed by this thread
        except BaseException as error:
            build_error.append(error)
            return
        finally:
            built.set()
        try:
            while not self._stopping:
                outputs = self.engine.step()  # waits for the core's next step
                self._deliver(outputs)
                self._refresh_stats(idle=not self.engine.has_unfinished_requests())
                if self.engine.is_dead:
                    raise EngineDeadError(self.engine.dead_reason)
        except BaseException as error:  # the loop must never die silently
            if not self._stopping:  # at shutdown the core's end is expected
                logger.exception("engine loop failed")
                self._fail(error)

    def _refresh_stats(self, idle: bool) -> None:
        """Snapshots are taken here, on the loop thread, so they never see a half-done step. An
        idle engine's is taken at once, and the first busy step after it replaces it at once: were
        the interval counted from the idle one, an engine that empties more often than every
        STATS_INTERVAL_S (short requests at light load) would report itself empty throughout."""
        now = time.monotonic()
        if idle or self._stats_idle or now - self._stats_time >= STATS_INTERVAL_S:
            self._stats = self.engine.stats_snapshot()
            self._stats_time = now
            self._stats_idle = idle

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one wake-up of each caller's event loop per step
        (each call_soon_threadsafe writes to the loop's wake-up socket), not one per output."""
        with self._lock:
            streams = [(self._streams.get(o.request_id), o) for o in outputs]
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for stream, output in streams:
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_fold_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error if isinstance(error, EngineDeadError) else EngineDeadError(f"engine loop failed: {error!r}")
        self._end_streams(self._error)

    def _end_streams(self, error: EngineDeadError) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.put(error)
