"""InprocClient: the engine core in the front end's own process.

The thread that calls `get_output` steps the core; other threads only `send`. A message is applied
at once when no step is running (so a single-threaded caller, `LLM.generate`, sees every add, abort
and stop take effect before it returns), and otherwise queued for the stepping thread, which takes
every queued message before its next step: a caller never waits for a step. With nothing to do,
`get_output` sleeps on a condition variable: an idle engine uses no CPU.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from pagedserve.config import EngineConfig, WorkerPlacement
from pagedserve.engine.core.client import EngineCoreClient
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.core.messages import CoreOutputs
from pagedserve.engine.core.model_setup import resolve_core_model_config

logger = logging.getLogger(__name__)


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, placement: WorkerPlacement | None = None):
        super().__init__()
        self.engine_core = EngineCore(config, resolve_core_model_config(config), placement)
        self.model_config = self.engine_core.model_config
        self.num_kv_blocks = self.engine_core.num_kv_blocks
        self._step_lock = threading.Lock()  # held while the core runs a step or takes messages
        self._wakeup = threading.Condition()  # guards the three fields below
        self._inbox: deque[object] = deque()
        self._has_news = False  # a message came since the stepping thread last looked
        self._is_closed = False
        self._step_started: float | None = None

    @property
    def step_started(self) -> float | None:
        return self._step_started

    def _send(self, message: object) -> None:
        with self._wakeup:
            self._inbox.append(message)
            self._has_news = True
            self._wakeup.notify()
        if self._step_lock.acquire(blocking=False):  # no step running: apply it now
            try:
                self._take_messages()
            finally:
                self._step_lock.release()

    def _get_output(self) -> CoreOutputs:
        while True:
            with self._wakeup:
                self._has_news = False
            with self._step_lock:
                self._take_messages()
                if self._is_closed:
                    raise EOFError("the engine core was shut down")
                if self.engine_core.has_work():
                    return self._step()
                report = self.engine_core.idle_report()
                if report is not None:
                    return report
            with self._wakeup:
                while not (self._has_news or self._is_closed):
                    self._wakeup.wait()

    def _step(self) -> CoreOutputs:
        self._step_started = time.monotonic()
        try:
            return self.engine_core.step()
        finally:
            self._step_started = None

    def _take_messages(self) -> None:
        """Under the step lock: apply every queued message, in order."""
        while True:
            with self._wakeup:
                if not self._inbox:
                    return
                message = self._inbox.popleft()
            self.engine_core.handle(message)

    def exit_reason(self) -> str:
        return self.engine_core.dead_reason or "the engine is shutting down"

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._wakeup:
            self._is_closed = True
            self._wakeup.notify_all()
        is_locked = self._step_lock.acquire(timeout=timeout)
        if not is_locked:
            logger.warning("an engine step is still running after %.0f s; releasing the workers under it", timeout)
        try:
            self.engine_core.shutdown()
        finally:
            if is_locked:
                self._step_lock.release()
