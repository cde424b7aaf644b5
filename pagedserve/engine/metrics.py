"""Engine statistics: cumulative counters and latency histograms, vLLM's metric set.

The output processor records as tokens arrive; `LLMEngine.stats_snapshot()` adds the scheduler's
gauges. Snapshots are plain picklable data, so a server can ship them between processes and sum
several engines' snapshots before rendering them for Prometheus.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass, field

from pagedserve.engine.outputs import FinishReason

# Upper bucket bounds in seconds (vLLM's choices).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative), then +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def add(self, other: Histogram) -> None:
        assert self.buckets == other.buckets
        self.counts = [a + b for a, b in zip(self.counts, other.counts)]
        self.total += other.total
        self.count += other.count


@dataclass
class EngineStats:
    # Counters (cumulative since the engine started).
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    request_success_total: dict[str, int] = field(default_factory=dict)  # by finish reason
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0  # tokens looked up
    prefix_cache_hits_total: int = 0  # tokens found
    # Gauges (at snapshot time).
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0  # 0..1, as vLLM; the mean over engines once summed
    num_engines: int = 1  # how many engines' snapshots were summed into this one
    # Histograms (seconds).
    time_to_first_token_seconds: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency_seconds: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_request_latency_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))
    request_queue_time_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS))

    def record_finished(self, reason: FinishReason, e2e_latency: float) -> None:
        self.request_success_total[reason.value] = self.request_success_total.get(reason.value, 0) + 1
        self.e2e_request_latency_seconds.observe(e2e_latency)

    def copy(self) -> EngineStats:
        return copy.deepcopy(self)

    def add(self, other: EngineStats) -> None:
        """Sum another engine's snapshot into this one (a server with several replicas)."""
        for name in (
            "prompt_tokens_total", "generation_tokens_total", "num_preemptions_total",
            "prefix_cache_queries_total", "prefix_cache_hits_total",
            "num_requests_running", "num_requests_waiting",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        total = self.num_engines + other.num_engines
        self.kv_cache_usage_perc = (
            self.kv_cache_usage_perc * self.num_engines + other.kv_cache_usage_perc * other.num_engines
        ) / total
        self.num_engines = total
        for reason, count in other.request_success_total.items():
            self.request_success_total[reason] = self.request_success_total.get(reason, 0) + count
        for name in HISTOGRAMS:
            getattr(self, name).add(getattr(other, name))


HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)
