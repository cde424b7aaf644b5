"""The one interface the front end (LLMEngine) has to its engine core, with two implementations:
InprocClient (the core in this process, stepped by the caller's thread) and MPClient (the core in
its own process, vLLM v1's EngineCoreProc); `make_client` (beside them, so this base imports
neither) picks one. Both carry the same messages (messages.py) and answer
with the same CoreOutputs, so nothing above this module branches on where the core runs.

- `send` may be called from any thread and never waits for a step;
- `get_output` blocks until the core's next step (or an idle report) and is called by one thread;
- `num_waiting_requests` is the one count of engine requests waiting for a slot, for admission.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

from pagedserve.config import ModelConfig
from pagedserve.engine.core.messages import AddRequest, CoreOutputs, SchedulerGauges
from pagedserve.engine.engine_core_output import StepOutputs


class EngineCoreClient(ABC):
    model_config: ModelConfig  # as the core resolved it (max_model_len capped to the KV cache)
    num_kv_blocks: int

    def __init__(self) -> None:
        self._count_lock = threading.Lock()
        self._num_sent_children = 0  # children of every AddRequest sent
        self._last = CoreOutputs(StepOutputs())  # the core's latest report: its gauges and children taken in

    def send(self, message: object) -> None:
        """Hand a message (AddRequest, AbortRequests, StopRequests) to the core, in order."""
        if isinstance(message, AddRequest):
            with self._count_lock:
                self._num_sent_children += message.params.n
        self._send(message)

    def get_output(self) -> CoreOutputs:
        """The core's next step; EOFError once the core has gone (shut down, or its process died)."""
        outputs = self._get_output()
        self._last = outputs
        return outputs

    @property
    def gauges(self) -> SchedulerGauges:
        """The scheduler's gauges as of the core's latest report."""
        return self._last.gauges

    @property
    def num_waiting_requests(self) -> int:
        """Engine requests waiting for a slot: the core's waiting queue at its latest report, and
        the children sent since that it had not taken in then."""
        with self._count_lock:
            num_on_their_way = self._num_sent_children - self._last.num_added_children
        return self._last.gauges.num_requests_waiting + num_on_their_way

    @property
    @abstractmethod
    def step_started(self) -> float | None:
        """time.monotonic() when the core's running step began; None between steps."""

    @abstractmethod
    def _send(self, message: object) -> None: ...

    @abstractmethod
    def _get_output(self) -> CoreOutputs: ...

    @abstractmethod
    def exit_reason(self) -> str:
        """Why get_output raised EOFError."""

    @abstractmethod
    def shutdown(self, timeout: float = 30.0) -> None:
        """The core finishes its running step (waited for at most `timeout`), releases its
        workers and stops. Idempotent."""
