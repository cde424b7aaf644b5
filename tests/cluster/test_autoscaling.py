"""Autoscaling on engine load: requests that queue in the engine's scheduler add a replica, an idle
server goes back to one, and no request fails on the way (tiny model, two batch slots per
replica, low thresholds and short delays)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import openai
import pytest

from pagedserve.cluster.autoscaling import BATCH_USAGE_METRIC, KV_USAGE_METRIC, NUM_WAITING_METRIC, EngineLoadPolicy
from pagedserve.cluster.server_config import AutoscalingConfig, DeploymentConfig, ServerConfig
from tests.cluster.conftest import deploy, wait_until

APP = "autoscaly"
MAX_TOKENS = 24
NUM_CLIENTS = 6  # against 2 batch slots: 4 requests wait in the scheduler


def running_replicas() -> int:
    from ray import serve

    application = serve.status().applications.get(APP)
    if application is None:
        return 0
    return application.deployments["LLMServer"].replica_states.get("RUNNING", 0)


def replica_count_is(count: int):
    return lambda: running_replicas() == count


async def closed_loop_load(base_url: str, stop: asyncio.Event) -> list[openai.types.Completion]:
    """NUM_CLIENTS clients, each sending its next request when the last one is answered."""
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one_client(index: int) -> list:
        answers = []
        while not stop.is_set():
            answers.append(
                await client.completions.create(
                    model=APP, prompt=f"Client {index} says", max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
                )
            )
        return answers

    try:
        per_client = await asyncio.gather(*(one_client(i) for i in range(NUM_CLIENTS)))
    finally:
        await client.close()
    return [answer for answers in per_client for answer in answers]


def test_queued_requests_scale_out_and_idle_scales_back(serve_url, model_dirs):
    from ray import serve

    autoscaling = AutoscalingConfig(
        min_replicas=1,
        max_replicas=2,
        target_waiting_per_replica=1,
        upscale_delay_s=1,
        downscale_delay_s=3,
        look_back_period_s=1,
        metrics_interval_s=0.25,
    )
    config = ServerConfig(
        model=str(model_dirs["llama"]),
        served_model_name=APP,
        engine={"max_model_len": 128, "max_num_seqs": 2},
        deployment=DeploymentConfig(autoscaling=autoscaling),
    )
    deploy(config, APP, f"/{APP}")
    base_url = f"{serve_url}/{APP}"
    try:
        assert running_replicas() == 1

        async def load_until_scaled_out() -> list:
            stop = asyncio.Event()
            load = asyncio.ensure_future(closed_loop_load(base_url, stop))
            # The event loop must keep serving the load while we poll Serve's status.
            await asyncio.to_thread(wait_until, replica_count_is(2), 180, 0.25, "a second replica under load")
            stop.set()
            return await load

        answers = asyncio.run(load_until_scaled_out())
        assert len(answers) >= NUM_CLIENTS
        for answer in answers:  # every request of the load completed, whole
            assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == MAX_TOKENS

        wait_until(replica_count_is(1), 180, 0.25, "back to one replica when idle")
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert client.completions.create(model=APP, prompt="Still there?", max_tokens=4).usage.completion_tokens == 4
    finally:
        serve.delete(APP)


def context(waiting: dict, kv: dict, batch: dict, queued: float = 0.0, target: int = 1) -> SimpleNamespace:
    """What Serve hands a policy: per-metric, per-replica averages over the look-back window."""
    metrics = {NUM_WAITING_METRIC: waiting, KV_USAGE_METRIC: kv, BATCH_USAGE_METRIC: batch}
    return SimpleNamespace(aggregated_metrics={k: v for k, v in metrics.items() if v}, total_queued_requests=queued, target_num_replicas=target)


@pytest.mark.parametrize(
    "ctx, desired",
    [
        (context({}, {}, {}, target=3), 3),  # no reports yet: hold
        (context({"a": 0}, {"a": 0.0}, {"a": 0.0}, target=2), 0),  # idle: min_replicas decides
        (context({"a": 6}, {"a": 0.2}, {"a": 1.0}), 3),  # 6 waiting at 2 per replica
        (context({"a": 0}, {"a": 0.2}, {"a": 1.0}), 1),  # full batch, nothing waiting: hold one
        (context({"a": 0, "b": 0}, {"a": 0.1, "b": 0.1}, {"a": 0.5, "b": 0.5}, target=2), 1),  # fits in one
        (context({"a": 0, "b": 0}, {"a": 0.6, "b": 0.6}, {"a": 0.5, "b": 0.5}, target=2), 2),  # 1.2 / 0.8 KV
        (context({"a": 0}, {"a": 0.1}, {"a": 1.0}, queued=4), 2),  # queued at Serve's handles waits too
        (context({"a": 0, "b": 0, "c": 0}, {"a": 0.8, "b": 0.8, "c": 0.8}, {"a": 0.1, "b": 0.1, "c": 0.1}), 3),  # no float noise
    ],
)
def test_policy_asks_for_the_replicas_the_load_needs(ctx, desired):
    policy = EngineLoadPolicy(target_waiting_per_replica=2, target_kv_usage=0.8, target_batch_usage=1.0)
    replicas, state = policy(ctx)
    assert (math.ceil(replicas), state) == (desired, {})  # Serve rounds up


@pytest.mark.parametrize(
    "autoscaling, message",
    [
        ({"max_replicas": 0}, "setting 'deployment.autoscaling.max_replicas' (got 0): Input should be greater than or equal to 1"),
        ({"target_kv_usage": 1.5}, "setting 'deployment.autoscaling.target_kv_usage' (got 1.5): Input should be less than or equal to 1"),
        ({"min_replicas": 3, "max_replicas": 2}, "autoscaling max_replicas (2) must be >= min_replicas (3)"),
        ({"target_waiting": 2}, "unknown setting 'deployment.autoscaling.target_waiting'"),
        ({"look_back_period_s": 1, "metrics_interval_s": 2}, "look_back_period_s (1) must be > metrics_interval_s (2)"),
    ],
)
def test_bad_autoscaling_settings_are_named(autoscaling, message):
    with pytest.raises(ValueError) as error:
        ServerConfig.load(overrides={"autoscaling": autoscaling})
    assert message in str(error.value)


def test_one_way_to_autoscale():
    with pytest.raises(ValueError, match="either deployment.autoscaling .* or deployment.autoscaling_config"):
        ServerConfig.load(overrides={"autoscaling": {}, "autoscaling_config": {"max_replicas": 2}})


def test_the_autoscaling_flag_takes_a_json_object():
    import argparse

    from pagedserve.cli_args import add_model_arguments, given_fields

    parser = argparse.ArgumentParser()
    add_model_arguments(parser, DeploymentConfig)
    given = given_fields(parser.parse_args(["--autoscaling", '{"max_replicas": 3, "target_kv_usage": 0.5}']), DeploymentConfig)
    config = ServerConfig.load(overrides=given)
    assert config.deployment.autoscaling == AutoscalingConfig(max_replicas=3, target_kv_usage=0.5)
    assert config.deployment.max_num_replicas == 3
