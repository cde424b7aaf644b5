"""The metrics hub sums replicas' statistics and renders valid Prometheus text."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.metrics_hub import MetricsHub
from pagedserve.engine.metrics import EngineStats


def stats(tokens: int, running: int, usage: float) -> EngineStats:
    s = EngineStats(generation_tokens_total=tokens, num_requests_running=running, kv_cache_usage_perc=usage)
    s.record_finished("stop", 0.7)
    s.time_to_first_token_seconds.observe(0.03)
    s.time_to_first_token_seconds.observe(3.0)
    return s


def samples(text: str) -> dict:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_replicas_are_summed_per_model():
    hub = MetricsHub()
    hub.report("m", "r1", stats(5, 2, 0.5))
    hub.report("m", "r2", stats(7, 1, 0.25))
    hub.report("m", "r1", stats(6, 0, 0.0))  # a newer snapshot replaces the replica's older one
    hub.report("other", "r3", stats(1, 1, 1.0))
    values = samples(hub.render())
    m = (("model_name", "m"),)
    assert values[("pagedserve:generation_tokens_total", m)] == 13
    assert values[("pagedserve:num_requests_running", m)] == 1
    assert values[("pagedserve:kv_cache_usage_perc", m)] == 0.125  # the mean, not the sum
    assert values[("pagedserve:request_success_total", (("finished_reason", "stop"), *m))] == 2
    assert values[("pagedserve:time_to_first_token_seconds_count", m)] == 4
    assert values[("pagedserve:time_to_first_token_seconds_bucket", (("le", "0.04"), *m))] == 2
    assert values[("pagedserve:time_to_first_token_seconds_bucket", (("le", "+Inf"), *m))] == 4
    assert values[("pagedserve:generation_tokens_total", (("model_name", "other"),))] == 1


def test_stale_replicas_keep_counters_but_not_gauges(monkeypatch):
    import pagedserve.cluster.metrics_hub as hub_module

    hub = MetricsHub()
    hub.report("m", "gone", stats(9, 3, 0.5))
    now = hub_module.time.monotonic()
    monkeypatch.setattr(hub_module.time, "monotonic", lambda: now + hub_module.STALE_AFTER_S + 1)
    values = samples(hub.render())
    assert values[("pagedserve:generation_tokens_total", (("model_name", "m"),))] == 9
    assert values[("pagedserve:num_requests_running", (("model_name", "m"),))] == 0


def test_label_values_are_escaped():
    hub = MetricsHub()
    hub.report('we"ird\\name', "r", stats(1, 0, 0.0))
    values = samples(hub.render())
    assert values[("pagedserve:generation_tokens_total", (("model_name", 'we"ird\\name'),))] == 1
