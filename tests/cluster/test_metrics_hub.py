"""The metrics hub exports each replica's statistics as its own series, in valid Prometheus text
rendered by prometheus_client; the ingress's /health and /metrics answer from a cached call and
time out a dead hub."""

from __future__ import annotations

import pickle
from dataclasses import fields

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.metrics_hub import MetricsHub
from pagedserve.engine.engine_core_output import FinishReason
from pagedserve.engine.metrics import TTFT_BUCKETS, EngineStats


def stats(tokens: int, running: int, usage: float) -> EngineStats:
    s = EngineStats(generation_tokens_total=tokens, num_requests_running=running, kv_cache_usage_perc=usage)
    s.record_finished(FinishReason.STOP, 0.7)
    s.time_to_first_token_seconds.observe(0.03)
    s.time_to_first_token_seconds.observe(3.0)
    return s


def samples(text: str) -> dict:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def series(model: str, replica: str, **labels: str) -> tuple:
    return tuple(sorted({"model_name": model, "replica": replica, **labels}.items()))


def test_each_replica_is_its_own_series():
    hub = MetricsHub()
    hub.report("m", "r1", stats(5, 2, 0.5))
    hub.report("m", "r2", stats(7, 1, 0.25))
    hub.report("m", "r1", stats(6, 0, 0.0))  # a newer snapshot replaces the replica's older one
    hub.report("other", "r3", stats(1, 1, 1.0))
    values = samples(hub.render())
    assert values[("pagedserve:generation_tokens_total", series("m", "r1"))] == 6
    assert values[("pagedserve:generation_tokens_total", series("m", "r2"))] == 7
    assert values[("pagedserve:generation_tokens_total", series("other", "r3"))] == 1
    assert values[("pagedserve:num_requests_running", series("m", "r1"))] == 0
    assert values[("pagedserve:kv_cache_usage_perc", series("m", "r2"))] == 0.25
    assert values[("pagedserve:request_success_total", series("m", "r2", finished_reason="stop"))] == 1
    assert values[("pagedserve:time_to_first_token_seconds_count", series("m", "r1"))] == 2
    assert values[("pagedserve:time_to_first_token_seconds_sum", series("m", "r1"))] == 3.03
    assert values[("pagedserve:time_to_first_token_seconds_bucket", series("m", "r1", le="0.04"))] == 1
    assert values[("pagedserve:time_to_first_token_seconds_bucket", series("m", "r1", le="+Inf"))] == 2
    bounds = [dict(labels)["le"] for name, labels in values if name.endswith("first_token_seconds_bucket") and ("replica", "r1") in labels]
    assert bounds == [str(bound) for bound in TTFT_BUCKETS] + ["+Inf"]  # vLLM's bounds
    assert not any(name.endswith("_created") for name, _ in values)


def test_every_field_of_engine_stats_is_exported_with_its_kind():
    hub = MetricsHub()
    hub.report("m", "r", stats(1, 0, 0.0))
    families = {family.name: family.type for family in text_string_to_metric_families(hub.render())}
    for spec in fields(EngineStats):
        name = "pagedserve:" + spec.name.removesuffix("_total")
        assert families.get(name) == spec.metadata["kind"], name


def test_stale_replicas_keep_counters_but_not_gauges(monkeypatch):
    import pagedserve.cluster.metrics_hub as hub_module

    hub = MetricsHub()
    hub.report("m", "gone", stats(9, 3, 0.5))
    now = hub_module.time.monotonic()
    monkeypatch.setattr(hub_module.time, "monotonic", lambda: now + hub_module.STALE_AFTER_S + 1)
    hub.report("m", "live", stats(2, 1, 0.5))
    values = samples(hub.render())
    assert values[("pagedserve:generation_tokens_total", series("m", "gone"))] == 9
    assert values[("pagedserve:time_to_first_token_seconds_count", series("m", "gone"))] == 2
    assert ("pagedserve:num_requests_running", series("m", "gone")) not in values
    assert values[("pagedserve:num_requests_running", series("m", "live"))] == 1


def test_every_replicas_report_names_its_models_retired_adapters(monkeypatch):
    """The ingress's unload reaches replicas through their reports' replies, per model, bounded."""
    import pagedserve.cluster.metrics_hub as hub_module

    hub = MetricsHub()
    assert hub.report("m", "r1", stats(1, 0, 0.0)) == []
    hub.retire_lora("m", 7)
    hub.retire_lora("m", 9)
    assert hub.report("m", "r1", stats(1, 0, 0.0)) == [7, 9]
    assert hub.report("m", "r2", stats(1, 0, 0.0)) == [7, 9]  # every replica, every report
    assert hub.report("other", "r3", stats(1, 0, 0.0)) == []
    monkeypatch.setattr(hub_module, "MAX_RETIRED_LORAS", 2)
    hub.retire_lora("m", 11)
    assert hub.report("m", "r1", stats(1, 0, 0.0)) == [9, 11]  # the oldest forgotten


def test_adapter_ids_are_never_handed_out_twice():
    """An ingress restarted counts from its --lora-modules again; the hub's ids still go up."""
    hub = MetricsHub()
    assert [hub.new_lora_id(4), hub.new_lora_id(5)] == [4, 5]
    assert hub.new_lora_id(4) == 6  # a restarted ingress asking from its first free id again
    assert hub.new_lora_id(10) == 10


def test_label_values_are_escaped():
    hub = MetricsHub()
    hub.report('we"ird\\name', "r", stats(1, 0, 0.0))
    values = samples(hub.render())
    assert values[("pagedserve:generation_tokens_total", series('we"ird\\name', "r"))] == 1


def test_a_snapshot_survives_pickling_and_does_not_follow_later_recording():
    live = stats(3, 1, 0.5)
    snapshot = live.copy()
    live.time_to_first_token_seconds.observe(0.002)
    live.record_finished(FinishReason.ABORT, 1.0)
    shipped = pickle.loads(pickle.dumps(snapshot))
    assert shipped.request_success_total == {"stop": 1}
    [family] = shipped.time_to_first_token_seconds.collect()
    values = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert values[("time_to_first_token_seconds_count", None)] == 2
    assert values[("time_to_first_token_seconds_sum", None)] == 3.03
    assert values[("time_to_first_token_seconds_bucket", "0.04")] == 1
    assert values[("time_to_first_token_seconds_bucket", "0.005")] == 0  # the later 0.002 stayed live


# ---- /health and /metrics in the ingress ----------------------------------------------------


class _Method:
    """A deployment handle's method whose `.remote()` counts calls and answers after `delay_s`
    (None: never, as a dead replica's handle call can hang)."""

    def __init__(self, answer, delay_s: float | None = 0.05):
        self.answer, self.delay_s, self.num_calls = answer, delay_s, 0

    def remote(self):
        import asyncio

        self.num_calls += 1

        async def reply():
            await asyncio.sleep(self.delay_s if self.delay_s is not None else 3600)
            return self.answer

        return reply()


class _FakeHandle:
    def __init__(self, **methods):
        self.__dict__.update(methods)

    def options(self, **kwargs):
        return self


def _ingress(servers: dict, hub) -> object:
    """The ingress class itself (Serve's wrapper subclasses it), built outside Serve on fakes:
    a unit test of its /health and /metrics logic."""
    from pagedserve.cluster.ingress import OpenAIIngress

    user_class = OpenAIIngress.__mro__[1]
    return user_class(servers, hub)


def test_a_burst_of_health_checks_is_one_call_per_replica():
    import asyncio

    replicas = [_Method(True) for _ in range(2)]
    ingress = _ingress({f"m{i}": _FakeHandle(is_healthy=m) for i, m in enumerate(replicas)}, _FakeHandle())

    async def burst():
        return await asyncio.gather(*(ingress.health() for _ in range(200)))

    responses = asyncio.run(burst())
    assert [r.status_code for r in responses] == [200] * 200
    assert [m.num_calls for m in replicas] == [1, 1]
    asyncio.run(burst())  # within a second: the same answer
    assert [m.num_calls for m in replicas] == [1, 1]


def test_health_is_asked_again_once_the_answer_is_a_second_old():
    import asyncio

    replica = _Method(True, delay_s=0)
    ingress = _ingress({"m": _FakeHandle(is_healthy=replica)}, _FakeHandle())
    ingress.health_probe.max_age_s = 0.2  # (Serve's copy of the class has its own module globals)

    async def twice():
        await ingress.health()
        await asyncio.sleep(0.3)
        return await ingress.health()

    assert asyncio.run(twice()).status_code == 200 and replica.num_calls == 2
    replica.answer = False  # the engine died
    asyncio.run(asyncio.sleep(0.3))
    assert asyncio.run(ingress.health()).status_code == 503


def test_a_dead_metrics_hub_is_a_503_not_a_hang():
    import asyncio
    import time

    hub = _Method("text", delay_s=None)
    ingress = _ingress({}, _FakeHandle(render=hub))
    ingress.metrics_text.timeout_s = 0.5

    async def scrapes():
        return await asyncio.gather(*(ingress.metrics() for _ in range(50)))

    started = time.monotonic()
    responses = asyncio.run(scrapes())
    assert time.monotonic() - started < 3
    assert {r.status_code for r in responses} == {503} and hub.num_calls == 1
    assert b"metrics hub did not answer" in responses[0].body
    live = _ingress({}, _FakeHandle(render=_Method("pagedserve:x 1\n")))
    assert asyncio.run(live.metrics()).body == b"pagedserve:x 1\n"


def test_metrics_can_require_the_api_key():
    """metrics_require_api_key: /metrics is no longer open; /health stays open for probes."""
    from pagedserve.cluster.ingress import OpenAIIngress, key_digest
    from pagedserve.cluster.openai_serving import APIError

    user_class = OpenAIIngress.__mro__[1]
    default = user_class({}, _FakeHandle(), None, key_digest("key"))
    default.authorize_path("/metrics", "")  # open by default: scrapers usually carry no key
    strict = user_class({}, _FakeHandle(), None, key_digest("key"), metrics_require_api_key=True)
    with pytest.raises(APIError, match="invalid or missing API key"):
        strict.authorize_path("/metrics", "")
    strict.authorize_path("/metrics", "Bearer key")
    strict.authorize_path("/health", "")
    with pytest.raises(APIError):
        strict.authorize_path("/v1/completions", "Bearer other")
