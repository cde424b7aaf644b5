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
from typing import Any, AsyncIterator, Callable

from pagedserve.config import EngineConfig
from pagedserve.engine.input_processor import PromptType
from pagedserve.engine.llm_engine import EngineDeadError, LLMEngine
from pagedserve.engine.request_output import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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
    def __init__(self, config: EngineConfig, on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None):
        """`on_step(engine, outputs)` runs on the loop thread after every step (metrics)."""
        self.engine = LLMEngine(config)
        self.on_step = on_step
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._commands: deque[tuple] = deque()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopping = False
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
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._commands.append(("add", request_id, processed, sampling_params, time.monotonic()))
            self._wakeup.notify()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
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

    def num_unfinished_requests(self) -> int:
        with self._lock:
            return len(self._streams)

    def _raise_if_dead(self) -> None:
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")

    # ---- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._commands or self._stopping or self.engine.has_unfinished_requests()):
                        self._wakeup.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._deliver(outputs)
                    if self.on_step is not None:
                        self.on_step(self.engine, outputs)
                    if self.engine.is_dead:
                        raise EngineDeadError(self.engine.dead_reason)
        except BaseException as error:  # the loop must never die silently
            logger.exception("engine loop failed")
            self._fail(error)

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
