"""One async call's answer, shared by everyone who asks within a short while.

Load balancers and Prometheus poll `/health` and `/metrics`, and a burst of them must not become a
burst of calls to every replica or to the metrics hub: askers while a call runs wait for that
call, and its answer (or its error) serves every asker for `max_age_s` after it came. A call that
takes longer than `timeout_s` fails with TimeoutError, so a dead or wedged callee is an error
soon, never a hung request.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class CachedResult(Generic[T]):
    def __init__(self, fetch: Callable[[], Awaitable[T]], max_age_s: float, timeout_s: float):
        self.fetch = fetch
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self._task: asyncio.Future[T] | None = None
        self._done_at = 0.0  # time.monotonic() when the latest call ended
        self.num_calls = 0  # calls made (tests and logs read it)

    async def get(self) -> T:
        """The latest answer if it is fresh, else a new call's (shared with concurrent askers).
        Raises what the call raised, or TimeoutError after `timeout_s`."""
        task = self._task
        if task is None or (task.done() and time.monotonic() - self._done_at > self.max_age_s):
            task = self._task = asyncio.ensure_future(self._call())
        # Shielded: one asker that goes away (a client disconnect) cancels only its own wait.
        return await asyncio.shield(task)

    async def _call(self) -> T:
        self.num_calls += 1
        try:
            return await asyncio.wait_for(self.fetch(), self.timeout_s)
        finally:
            self._done_at = time.monotonic()
