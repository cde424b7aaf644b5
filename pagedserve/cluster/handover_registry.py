"""Which replica serves each engine request the ingress watches, and which replicas are leaving:
what the router (handover_router.py) publishes and `ResumingClient` (handover.py) watches."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Iterable

MAX_REMEMBERED_LEAVING = 1024  # leaving replica ids kept (each is unique; a few per redeploy)


class HandoverRegistry:
    """Process-local (one per ingress process): which replica serves each watched engine request,
    and which replicas are leaving. Thread-safe: Serve's router runs on its own event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replica_of: dict[str, str] = {}  # engine request id -> replica id
        self._watchers: dict[str, Callable[[], None]] = {}  # engine request id -> called when its replica leaves
        self._leaving: OrderedDict[str, None] = OrderedDict()  # replica ids, oldest first

    def watch(self, request_id: str, on_leaving: Callable[[], None]) -> None:
        """`on_leaving` is called (from any thread) once the request's replica is leaving."""
        with self._lock:
            self._watchers[request_id] = on_leaving

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._watchers.pop(request_id, None)
            self._replica_of.pop(request_id, None)

    def routed(self, request_id: str, replica_id: str) -> None:
        with self._lock:
            if request_id not in self._watchers:
                return  # not a request this process watches (or already done)
            self._replica_of[request_id] = replica_id
            watcher = self._watchers[request_id] if replica_id in self._leaving else None
        if watcher is not None:  # routed just before its replica left
            watcher()

    def replica_of(self, request_id: str) -> str | None:
        with self._lock:
            return self._replica_of.get(request_id)

    def mark_leaving(self, replica_ids: Iterable[str]) -> None:
        leaving = set(replica_ids)
        with self._lock:
            for replica_id in leaving:
                self._leaving[replica_id] = None
            while len(self._leaving) > MAX_REMEMBERED_LEAVING:
                self._leaving.popitem(last=False)
            watchers = [self._watchers[r] for r, replica in self._replica_of.items() if replica in leaving and r in self._watchers]
        for watcher in watchers:
            watcher()

    def is_leaving(self, replica_id: str) -> bool:
        with self._lock:
            return replica_id in self._leaving


REGISTRY = HandoverRegistry()
