"""The metrics hub: one Serve replica that keeps every LLMServer replica's latest engine
statistics and renders their sum in Prometheus' text format, with vLLM's metric names under the
`pagedserve:` prefix and a `model_name` label."""

from __future__ import annotations

import time
from typing import Iterator

from pagedserve.engine.metrics import HISTOGRAMS, EngineStats

PREFIX = "pagedserve:"
# Gauges of a replica that stopped reporting this long ago are left out (it is gone).
STALE_AFTER_S = 15.0

_COUNTERS = {
    "prompt_tokens_total": "Prompt tokens processed.",
    "generation_tokens_total": "Tokens generated.",
    "num_preemptions_total": "Requests preempted (their blocks freed, to be recomputed).",
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits_total": "Prompt tokens found in the prefix cache.",
}
_GAUGES = {
    "num_requests_running": "Requests being computed.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (1 means full).",
}
_HISTOGRAM_HELP = {
    "time_to_first_token_seconds": "Time from arrival to the first generated token.",
    "inter_token_latency_seconds": "Time between consecutive generated tokens.",
    "e2e_request_latency_seconds": "Time from arrival to the end of a request.",
    "request_queue_time_seconds": "Time from arrival to the first scheduled step.",
}


class MetricsHub:
    def __init__(self) -> None:
        self.latest: dict[tuple[str, str], tuple[float, EngineStats]] = {}

    def report(self, model_name: str, replica_id: str, stats: EngineStats) -> None:
        self.latest[(model_name, replica_id)] = (time.monotonic(), stats)

    def render(self) -> str:
        return render(self.totals())

    def totals(self) -> dict[str, EngineStats]:
        """Per model: counters summed over every replica ever seen, gauges over the live ones."""
        now = time.monotonic()
        totals: dict[str, EngineStats] = {}
        for (model, _), (reported, stats) in self.latest.items():
            stats = stats.copy()
            if now - reported > STALE_AFTER_S:
                stats.num_requests_running = stats.num_requests_waiting = 0
            if model in totals:
                totals[model].add(stats)
            else:
                totals[model] = stats
        return totals


def render(totals: dict[str, EngineStats]) -> str:
    return "".join(line + "\n" for line in _lines(totals))


def _lines(totals: dict[str, EngineStats]) -> Iterator[str]:
    for name, help_text in _COUNTERS.items():
        yield from _header(name, help_text, "counter")
        for model, stats in totals.items():
            yield f'{PREFIX}{name}{{model_name="{_escape(model)}"}} {getattr(stats, name)}'
    yield from _header("request_success_total", "Finished requests, by finish reason.", "counter")
    for model, stats in totals.items():
        for reason, count in sorted(stats.request_success_total.items()):
            yield f'{PREFIX}request_success_total{{model_name="{_escape(model)}",finished_reason="{reason}"}} {count}'
    for name, help_text in _GAUGES.items():
        yield from _header(name, help_text, "gauge")
        for model, stats in totals.items():
            yield f'{PREFIX}{name}{{model_name="{_escape(model)}"}} {getattr(stats, name)}'
    for name in HISTOGRAMS:
        yield from _header(name, _HISTOGRAM_HELP[name], "histogram")
        for model, stats in totals.items():
            yield from _histogram(name, model, getattr(stats, name))


def _histogram(name: str, model: str, histogram) -> Iterator[str]:
    label = f'model_name="{_escape(model)}"'
    cumulative = 0
    for bound, count in zip((*histogram.buckets, float("inf")), histogram.counts):
        cumulative += count
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        yield f'{PREFIX}{name}_bucket{{{label},le="{le}"}} {cumulative}'
    yield f"{PREFIX}{name}_sum{{{label}}} {histogram.total}"
    yield f"{PREFIX}{name}_count{{{label}}} {histogram.count}"


def _header(name: str, help_text: str, kind: str) -> Iterator[str]:
    yield f"# HELP {PREFIX}{name} {help_text}"
    yield f"# TYPE {PREFIX}{name} {kind}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
