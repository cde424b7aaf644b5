"""The server's refusals: a missing or wrong API key (401), an overloaded deployment (503), and
an engine whose workers died and could not be rebuilt (503, /health too)."""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest
import requests

from pagedserve.config import ServerConfig
from tests.cluster.conftest import deploy

KEY = "sk-test-1234"


@pytest.fixture(scope="module")
def keyed_url(serve_url, model_dirs):
    """A key, and room for one running request plus one queued."""
    from ray import serve

    config = ServerConfig(
        model=str(model_dirs["llama"]),
        served_model_name="keyed",
        api_key=KEY,
        engine={"max_model_len": 512},
        deployment={"max_ongoing_requests": 1, "max_queued_requests": 1},
    )
    deploy(config, "keyed", "/keyed")
    yield f"{serve_url}/keyed"
    serve.delete("keyed")


def test_api_key_required(keyed_url):
    for key in ("wrong", KEY + "x", ""):
        bad = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=key or "missing", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert info.value.status_code == 401 and info.value.body["type"] == "AuthenticationError"
    no_header = requests.post(f"{keyed_url}/v1/completions", json={"model": "keyed", "prompt": "x"}, timeout=10)
    assert no_header.status_code == 401
    good = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="keyed", prompt="Hello", max_tokens=3).usage.completion_tokens >= 1
    # Load balancers and Prometheus carry no key.
    assert requests.get(f"{keyed_url}/health", timeout=10).status_code == 200
    assert requests.get(f"{keyed_url}/metrics", timeout=10).status_code == 200


def test_overload_is_503(keyed_url):
    async def one(client: openai.AsyncOpenAI) -> int:
        try:
            stream = await client.completions.create(
                model="keyed", prompt="Hello", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
            )
            async for _ in stream:
                pass
            return 200
        except openai.APIStatusError as error:
            assert error.body["type"] == "ServiceUnavailableError", error.body
            return error.status_code

    async def burst() -> list[int]:
        async with openai.AsyncOpenAI(base_url=f"{keyed_url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(6)))

    statuses = asyncio.run(burst())
    assert statuses.count(503) >= 1 and statuses.count(200) >= 1, statuses
    assert set(statuses) <= {200, 503}


@pytest.fixture(scope="module")
def fragile_url(serve_url, model_dirs):
    """Two Ray worker ranks and no restarts: killing one kills the engine."""
    from ray import serve

    config = ServerConfig(
        model=str(model_dirs["qwen3"]),
        served_model_name="fragile",
        engine={"max_model_len": 512, "tensor_parallel_size": 2, "max_worker_restarts": 0},
    )
    deploy(config, "fragile", "/fragile")
    yield f"{serve_url}/fragile"
    serve.delete("fragile")


def test_dead_engine_is_503(fragile_url, ray_cluster):
    from ray.util.state import list_actors

    client = openai.OpenAI(base_url=f"{fragile_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.completions.create(model="fragile", prompt="Hello", max_tokens=4).usage.completion_tokens >= 1
    # This session's cluster by address: other Ray clusters may run on the same machine.
    address = ray_cluster.get_runtime_context().gcs_address
    workers = list_actors(address=address, filters=[("class_name", "=", "Worker"), ("state", "=", "ALIVE")], detail=True)
    assert len(workers) == 2
    os.kill(workers[0].pid, signal.SIGKILL)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="fragile", prompt="Hello", max_tokens=8)
    assert info.value.status_code == 503 and "Traceback" not in info.value.body["message"]
    health = requests.get(f"{fragile_url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["error"]["type"] == "ServiceUnavailableError"
