"""Engine statistics: vLLM's metric set, recorded with prometheus_client.

The output processor records as tokens arrive; `LLMEngine.stats_snapshot()` copies in the
scheduler's gauges and counters. A snapshot is plain picklable data, so a server ships each
replica's to the metrics hub, which exports them per replica (`cluster/metrics_hub.py`).

`EngineStats`' fields are the one list of metrics: each field's metadata gives its Prometheus kind
and help text, and the hub exports exactly these fields, under their names.
"""

from __future__ import annotations

import copy
from dataclasses import Field, dataclass, field, fields

from prometheus_client import Histogram

from pagedserve.engine.engine_core_output import FinishReason

# Upper bucket bounds in seconds (vLLM's choices).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class SnapshotHistogram(Histogram):
    """prometheus_client's histogram, kept out of any registry, that survives pickling and
    copying: a replica's snapshot travels to the metrics hub. (prometheus_client's own holds
    locks; its bucket counts and sum are restored here through their `set`.)"""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        super().__init__(name, documentation, buckets=buckets, registry=None)

    def __reduce__(self):
        counts = [bucket.get() for bucket in self._buckets]  # per bucket, not cumulative
        return _restore_histogram, (self._name, self._documentation, tuple(self._upper_bounds), counts, self._sum.get())


def _restore_histogram(name: str, documentation: str, buckets: tuple[float, ...], counts: list[float], total: float) -> SnapshotHistogram:
    histogram = SnapshotHistogram(name, documentation, buckets)
    for bucket, count in zip(histogram._buckets, counts):
        bucket.set(count)
    histogram._sum.set(total)
    return histogram


def _counter(help_text: str) -> Field:
    return field(default=0, metadata={"kind": "counter", "help": help_text})


def _gauge(help_text: str) -> Field:
    return field(default=0, metadata={"kind": "gauge", "help": help_text})


def _histogram(help_text: str, buckets: tuple[float, ...]) -> Field:
    # Built in __post_init__, which knows the field's name (the metric's name).
    return field(default=None, metadata={"kind": "histogram", "help": help_text, "buckets": buckets})


@dataclass
class EngineStats:
    # Counters, cumulative since the engine started.
    prompt_tokens_total: int = _counter("Prompt tokens processed.")
    generation_tokens_total: int = _counter("Tokens generated.")
    num_preemptions_total: int = _counter("Requests preempted (their blocks freed, to be recomputed).")
    prefix_cache_queries_total: int = _counter("Prompt tokens looked up in the prefix cache.")
    prefix_cache_hits_total: int = _counter("Prompt tokens found in the prefix cache.")
    # Finished requests by FinishReason value: one series per reason, labelled "finished_reason".
    request_success_total: dict[str, int] = field(
        default_factory=dict, metadata={"kind": "counter", "help": "Finished requests, by finish reason.", "label": "finished_reason"}
    )
    # Gauges, as of the snapshot.
    num_requests_running: int = _gauge("Requests being computed.")
    num_requests_waiting: int = _gauge("Requests waiting to be scheduled.")
    kv_cache_usage_perc: float = _gauge("Fraction of KV-cache blocks in use (1 means full).")
    num_lora_adapters: int = _gauge("LoRA adapters the engine serves now (started with, loaded, or named by a request).")
    # Histograms, in seconds.
    time_to_first_token_seconds: SnapshotHistogram = _histogram("Time from arrival to the first generated token.", TTFT_BUCKETS)
    inter_token_latency_seconds: SnapshotHistogram = _histogram("Time between consecutive generated tokens.", ITL_BUCKETS)
    e2e_request_latency_seconds: SnapshotHistogram = _histogram("Time from arrival to the end of a request.", REQUEST_BUCKETS)
    request_queue_time_seconds: SnapshotHistogram = _histogram("Time from arrival to the first scheduled step.", REQUEST_BUCKETS)

    def __post_init__(self) -> None:
        for spec in fields(self):
            if spec.metadata["kind"] == "histogram" and getattr(self, spec.name) is None:
                setattr(self, spec.name, SnapshotHistogram(spec.name, spec.metadata["help"], spec.metadata["buckets"]))

    def record_finished(self, reason: FinishReason, e2e_latency: float) -> None:
        self.request_success_total[reason.value] = self.request_success_total.get(reason.value, 0) + 1
        self.e2e_request_latency_seconds.observe(e2e_latency)

    def copy(self) -> EngineStats:
        """A snapshot, independent of later recording (and picklable)."""
        return copy.deepcopy(self)
