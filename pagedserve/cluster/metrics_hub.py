"""The metrics hub: one Serve replica that keeps every LLMServer replica's latest engine
statistics and renders them for `GET /metrics` with prometheus_client, one series per replica
(labels `model_name` and `replica`; sums over replicas belong in PromQL), under vLLM's metric
names with the `pagedserve:` prefix.

Every replica reports to it each second, so it is also where the ingress posts the LoRA adapters
`/v1/unload_lora_adapter` retired: a report's reply names them, and each replica drops those it
holds (a Serve handle reaches one replica, the hub's replies reach all). It also hands out
adapter ids, so an ingress that restarts never gives a new adapter an id some replica still
binds to another folder."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import Field, fields
from typing import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pagedserve.engine.metrics import EngineStats

PREFIX = "pagedserve:"
# Gauges of a replica that stopped reporting this long ago are left out (it is gone); its
# counters and histograms stay, so totals never go backwards.
STALE_AFTER_S = 15.0
# Retired adapter ids remembered per model. Every live replica hears of one within a report or
# two; the bound only keeps an endless run of loads and unloads from growing the hub.
MAX_RETIRED_LORAS = 4096


class MetricsHub:
    def __init__(self) -> None:
        # (model name, replica id) -> (time.monotonic() of the report, the replica's snapshot)
        self.latest: dict[tuple[str, str], tuple[float, EngineStats]] = {}
        # A registry of its own: Ray's process-wide default one holds Ray's metrics.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_ReplicaCollector(self))
        self.retired_loras: dict[str, OrderedDict[int, None]] = {}  # model name -> lora_int_ids, oldest first
        self.next_lora_id = 1

    def report(self, model_name: str, replica_id: str, stats: EngineStats) -> list[int]:
        """Record a replica's snapshot; the reply is the model's retired adapter ids."""
        self.latest[(model_name, replica_id)] = (time.monotonic(), stats)
        return list(self.retired_loras.get(model_name, ()))

    def new_lora_id(self, at_least: int) -> int:
        """An adapter id never handed out before by this hub, and at least `at_least` (the
        ingress's own count, which covers the --lora-modules ids)."""
        lora_id = max(self.next_lora_id, at_least)
        self.next_lora_id = lora_id + 1
        return lora_id

    def retire_lora(self, model_name: str, lora_int_id: int) -> None:
        retired = self.retired_loras.setdefault(model_name, OrderedDict())
        retired[lora_int_id] = None
        while len(retired) > MAX_RETIRED_LORAS:
            retired.popitem(last=False)

    def render(self) -> str:
        """Every replica's series in Prometheus' text exposition format."""
        return generate_latest(self.registry).decode()


class _ReplicaCollector(Collector):
    """One metric family per field of EngineStats, with a series for each replica."""

    def __init__(self, hub: MetricsHub):
        self.hub = hub

    def collect(self) -> Iterator[Metric]:
        now = time.monotonic()
        reports = [
            ({"model_name": model, "replica": replica}, stats, now - reported <= STALE_AFTER_S)
            for (model, replica), (reported, stats) in sorted(self.hub.latest.items())
        ]
        for spec in fields(EngineStats):
            kind = spec.metadata["kind"]
            # A counter family is named without "_total"; its samples carry it.
            family = Metric(PREFIX + spec.name.removesuffix("_total"), spec.metadata["help"], kind)
            for labels, stats, is_live in reports:
                if kind == "gauge" and not is_live:
                    continue
                for name, extra_labels, value in _samples(spec, getattr(stats, spec.name)):
                    family.add_sample(PREFIX + name, {**labels, **extra_labels}, value)
            yield family


def _samples(spec: Field, value) -> Iterator[tuple[str, dict[str, str], float]]:
    """(sample name, its own labels, value) for one replica's value of one field."""
    if spec.metadata["kind"] == "histogram":
        (family,) = value.collect()
        for sample in family.samples:
            # Left out: a snapshot's histogram is created anew when it is unpickled here.
            if not sample.name.endswith("_created"):
                yield sample.name, sample.labels, sample.value
    elif isinstance(value, dict):  # a labelled counter
        for label_value, count in sorted(value.items()):
            yield spec.name, {spec.metadata["label"]: label_value}, count
    else:
        yield spec.name, {}, value
