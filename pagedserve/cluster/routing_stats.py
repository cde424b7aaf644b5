"""What an LLMServer replica tells the prefix-aware routers about itself, through Serve's routing
stats (`record_routing_stats`, called by the controller every `routing_stats_period_s` and
broadcast to every handle's router with the replica's info).

Serve delivers only the latest report of a replica (a router that was busy sees one report in
place of several), so the evictions ride as a cumulative count plus the keys evicted since the
previous report: a router that missed keys knows how many it missed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedserve.engine.core.block_pool import BlockPool
from pagedserve.engine.metrics import EngineStats

# Keys listed in one report at most (the report travels through the controller to every
# router); evictions beyond it are only counted.
MAX_REPORTED_EVICTIONS = 2048


@dataclass(frozen=True)
class RoutingStats:
    """One replica's report: its engine load and its KV cache's evictions."""

    report_index: int  # increases with every report: a router applies each report once
    num_running: int  # engine requests being computed
    num_waiting: int  # engine requests waiting for KV blocks or a batch slot
    kv_cache_usage: float  # fraction of KV blocks in use (1: full)
    num_total_blocks: int  # the cache's size: what a router remembers of this replica at most
    num_evicted_blocks: int  # cached blocks evicted since the engine started
    num_prefix_cache_resets: int  # whole-cache resets (a rebuilt worker group) since start
    # Routing keys (block_pool.routing_key) of blocks evicted since the previous report.
    evicted_routing_keys: list[int] = field(default_factory=list)
    # The replica drains (it was sent SIGTERM): routers never pick it (cluster/replica_drain.py).
    is_draining: bool = False
    # The LoRA adapters (lora_int_id) its engine has loaded: a request under one prefers it.
    lora_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoutingStats | None:
        """None for an empty or foreign report (a replica that has not reported yet)."""
        try:
            return cls(**data)
        except TypeError:
            return None


class RoutingStatsReporter:
    """The replica's side: turns engine statistics and the block pool's eviction log into
    reports. Called on the replica's event loop while the engine loop thread runs; it only
    pops from the pool's deque and reads counters, which is safe across threads. With the
    engine core in its own process the pool is out of reach (`pool` None): reports carry the load
    only, no evictions and a cache size of 0 (unknown), and routers keep their default bound."""

    def __init__(self, pool: BlockPool | None):
        self.pool = pool
        self.last: RoutingStats | None = None

    def report(self, stats: EngineStats, is_draining: bool = False, lora_ids: list[int] = ()) -> RoutingStats:
        """The next report; the previous one again when nothing changed (an idle replica then
        costs Serve no broadcast to every router)."""
        log = self.pool.evicted_routing_keys if self.pool is not None else ()
        keys = []
        while log and len(keys) < MAX_REPORTED_EVICTIONS:
            keys.append(log.popleft())
        report = dataclasses.replace(self._new_report(stats, keys, is_draining), lora_ids=sorted(lora_ids))
        if self.last is not None and not keys and dataclasses.replace(report, report_index=self.last.report_index) == self.last:
            return self.last
        self.last = report
        return report

    def _new_report(self, stats: EngineStats, keys: list[int], is_draining: bool) -> RoutingStats:
        return RoutingStats(
            report_index=self.last.report_index + 1 if self.last is not None else 1,
            num_running=stats.num_requests_running,
            num_waiting=stats.num_requests_waiting,
            kv_cache_usage=stats.kv_cache_usage_perc,
            num_total_blocks=self.pool.num_blocks if self.pool is not None else 0,
            num_evicted_blocks=self.pool.num_evicted_blocks if self.pool is not None else 0,
            num_prefix_cache_resets=self.pool.num_prefix_cache_resets if self.pool is not None else 0,
            evicted_routing_keys=keys,
            is_draining=is_draining,
        )
