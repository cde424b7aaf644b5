"""The threads grammars compile on. Neither grammar library can cancel a compile, and a spec can
make one run for minutes (or never end). In a fixed thread pool, two such compiles would hold
both threads, and every later constrained request would wait behind them for good.

So each compile runs on a daemon thread of its own, at most `max_workers` at once; the others
queue. A compile whose requests gave up on it (`abandon`, after their compile timeout) stops
counting against that limit: the next queued compile starts while it runs on, unheard. At most
`max_abandoned` threads are let go so (each holds its memory until its compile ends); past
that, an abandoned compile keeps its place, and the pool is as slow as a fixed one.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from pagedserve.workers.cpu_binding import unbound


class CompileFuture(Future):
    """A compile's future, with the time its thread started it (None while queued)."""

    started_at: float | None = None


class CompilePool:
    def __init__(self, max_workers: int, max_abandoned: int = 8):
        self.max_workers = max_workers
        self.max_abandoned = max_abandoned
        self.num_abandoned = 0
        self._lock = threading.Lock()
        self._running: set[CompileFuture] = set()  # started, and counted against max_workers
        self._queue: collections.deque[tuple[CompileFuture, Callable, tuple]] = collections.deque()
        self._is_shut_down = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> CompileFuture:
        future = CompileFuture()
        with self._lock:
            if self._is_shut_down:
                raise RuntimeError("the grammar compile pool is shut down")
            self._queue.append((future, fn, args))
            self._start_queued()
        return future

    def abandon(self, future: Future) -> bool:
        """Stop counting a running compile nobody waits for; True if it was let go."""
        with self._lock:
            if future.done() or future not in self._running or self.num_abandoned >= self.max_abandoned:
                return False
            self._running.discard(future)
            self.num_abandoned += 1
            self._start_queued()
        return True

    def shutdown(self) -> None:
        """Queued compiles are cancelled; running ones end on their own (daemon threads)."""
        with self._lock:
            self._is_shut_down = True
            queued, self._queue = self._queue, collections.deque()
        for future, _, _ in queued:
            future.cancel()

    def _start_queued(self) -> None:
        """Under the lock: start queued compiles while a slot is free."""
        while self._queue and len(self._running) < self.max_workers:
            future, fn, args = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            future.started_at = time.monotonic()
            self._running.add(future)
            with unbound():  # not on a bound step thread's one CPU (workers/cpu_binding.py)
                threading.Thread(target=self._run, args=(future, fn, args), name="grammar-compile", daemon=True).start()

    def _run(self, future: CompileFuture, fn: Callable, args: tuple) -> None:
        try:
            result = fn(*args)
        except BaseException as error:  # the request that waits reports it
            future.set_exception(error)
        else:
            future.set_result(result)
        with self._lock:
            self._running.discard(future)  # (an abandoned one is no longer there)
            self._start_queued()
