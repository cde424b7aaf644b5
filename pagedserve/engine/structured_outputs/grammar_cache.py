"""An LRU cache of grammar compilations, shared by every request with the same spec.

It holds futures, not results: a second request for a spec still compiling waits on the same
compilation instead of starting another. Failures stay cached too (a spec that failed fails again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future


class GrammarCache:
    def __init__(self, capacity: int):
        assert capacity >= 1
        self.capacity = capacity
        self.entries: OrderedDict[Hashable, Future] = OrderedDict()
        self.num_hits = 0
        self.num_misses = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get_or_submit(self, key: Hashable, submit: Callable[[], Future]) -> Future:
        future = self.entries.get(key)
        if future is not None:
            self.entries.move_to_end(key)
            self.num_hits += 1
            return future
        self.num_misses += 1
        future = self.entries[key] = submit()
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)  # the least recently used; its requests keep their future
        return future
