"""AsyncLLM: the engine loop in a background thread, streaming outputs to asyncio callers.

The loop thread alone touches the scheduler and the output processor (so neither needs locks);
callers validate their input in their own thread, then hand the request over through a command
queue. The loop sleeps on a condition variable whenever it has nothing to do: an idle engine uses
no CPU. Each request's outputs reach its caller through an asyncio queue on the caller's loop.

An error inside the loop (or an engine that died because its workers could not be rebuilt) is
delivered to every waiting caller; `is_healthy` turns false for health checks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator

from pagedserve.config import EngineConfig
from pagedserve.engine.input_processor import PromptType
from pagedserve.engine.llm_engine import EngineDeadError, LLMEngine
from pagedserve.engine.metrics import EngineStats
from pagedserve.engine.request_output import RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.2


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass


class AsyncLLM:
    def __init__(self, config: EngineConfig, placement_group: Any = None):
        """`placement_group`: a Ray Serve replica's, for the workers (see Executor.create)."""
        self.engine = LLMEngine(config, placement_group)
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._commands: deque[tuple] = deque()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._stats = self.engine.stats_snapshot()  # refreshed by the loop thread
        self._stats_time = 0.0
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, **kwargs: Any) -> AsyncLLM:
        return cls(EngineConfig.from_kwargs(**kwargs))

    # ---- callers' side -------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_healthy(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self.engine.is_dead

    @property
    def dead_reason(self) -> str | None:
        if self._error is not None:
            return str(self._error)
        return self.engine.dead_reason or (None if self._thread.is_alive() else "the engine loop has stopped")

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs until it finishes. Bad input raises ValueError before the
        first output; leaving the iteration early (a client that went away) aborts the request."""
        self._raise_if_dead()
        processed = self.engine.input_processor.process(prompt, sampling_params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._error is not None:  # the loop died after the check above: nobody would answer
                raise self._error
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._commands.append(("add", request_id, processed, sampling_params, time.monotonic()))
            self._wakeup.notify()
        finished = False
        merge = sampling_params.output_kind == RequestOutputKind.DELTA
        try:
            while not finished:
                item = await stream.queue.get()
                # Deltas that piled up while the caller was busy go out as one.
                while merge and not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():
                    later = stream.queue.get_nowait()
                    if isinstance(later, BaseException):
                        item = later
                        break
                    item.merge_delta(later)
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
            self._commands.append(("abort", request_id))
            self._wakeup.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._lock:
            self._stopping = True
            self._wakeup.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self.engine.shutdown()

    def stats(self) -> EngineStats:
        """The engine's latest statistics (at most STATS_INTERVAL_S old while it is busy)."""
        return self._stats

    def _raise_if_dead(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")

    # ---- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._refresh_stats(force=True)  # going idle: publish the final state
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._wakeup.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    self._refresh_stats()
                    if self.engine.is_dead:
                        raise EngineDeadError(self.engine.dead_reason)
        except BaseException as error:  # the loop must never die silently
            logger.exception("engine loop failed")
            self._fail(error)

    def _refresh_stats(self, force: bool = False) -> None:
        """Snapshots are taken here, on the loop thread, so they never see a half-done step."""
        now = time.monotonic()
        if force or now - self._stats_time >= STATS_INTERVAL_S:
            self._stats = self.engine.stats_snapshot()
            self._stats_time = now

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            self.engine.abort_request(command[1])
            return
        _, request_id, processed, params, arrival_time = command
        try:
            self.engine.add_processed_request(request_id, processed, params, arrival_time)
        except Exception as error:  # reaches only this request's caller
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            streams = [(self._streams.get(o.request_id), o) for o in outputs]
        for stream, output in streams:
            if stream is not None:
                stream.put(output)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._error = error if isinstance(error, EngineDeadError) else EngineDeadError(f"engine loop failed: {error!r}")
            streams = list(self._streams.values())
            self._streams.clear()
        for stream in streams:
            stream.put(self._error)
