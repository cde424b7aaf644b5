"""A crashed LLMServer replica (its process SIGKILLed mid-stream, as a lost node would be) never
hangs a client: every open request ends promptly with an error; Serve replaces the replica and
the server serves again."""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest
import requests

from pagedserve.cluster.server_config import ServerConfig
from tests.cluster.conftest import deploy, wait_until

APP = "crashy"
LONG = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def crashy_url(serve_url, model_dirs):
    from ray import serve

    config = ServerConfig(model=str(model_dirs["llama"]), served_model_name=APP, engine={"max_model_len": 512})
    deploy(config, APP, f"/{APP}")
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


def replica_pid(ray_cluster) -> int:
    from ray.util.state import list_actors

    address = ray_cluster.get_runtime_context().gcs_address
    actors = list_actors(address=address, filters=[("state", "=", "ALIVE")], detail=True, limit=10_000)
    pids = [a.pid for a in actors if a.class_name.endswith(f"{APP}:LLMServer")]
    assert len(pids) == 1, [a.class_name for a in actors]
    return pids[0]


def test_killed_replica_ends_every_stream(crashy_url, ray_cluster):
    async def stream(client: openai.AsyncOpenAI, started: asyncio.Event, chat: bool) -> str:
        try:
            if chat:
                response = await client.chat.completions.create(model=APP, messages=[{"role": "user", "content": "Hi"}], stream=True, **LONG)
            else:
                response = await client.completions.create(model=APP, prompt="Once upon a time", stream=True, **LONG)
            async for _ in response:
                started.set()
            return "finished"  # a stream that ends without an error lost its tail silently
        except openai.APIConnectionError:
            return "connection dropped"  # no error event: the client cannot tell a crash from a network fault
        except openai.APIError as error:  # the SSE error event
            return f"{error.body['type']}: {error.message}"

    async def whole(client: openai.AsyncOpenAI) -> str:
        try:
            await client.completions.create(model=APP, prompt="Hello", **LONG)
            return "finished"
        except openai.APIStatusError as error:
            assert error.status_code == 503 and error.response.headers["retry-after"] == "1"
            return f"{error.body['type']}: {error.message}"

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{crashy_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            started = [asyncio.Event() for _ in range(4)]
            calls = [asyncio.ensure_future(stream(client, event, chat=i % 2 == 1)) for i, event in enumerate(started)]
            calls += [asyncio.ensure_future(whole(client)) for _ in range(2)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=120)
            os.kill(replica_pid(ray_cluster), signal.SIGKILL)
            # Generous: the machine is loaded. A hung stream would wait out the client's 300 s.
            return await asyncio.wait_for(asyncio.gather(*calls), timeout=120)

    outcomes = asyncio.run(run())
    assert all(o.startswith("ServiceUnavailableError") and "replica" in o for o in outcomes), outcomes
    # Serve notices the dead replica and starts another; the server serves again.
    wait_until(lambda: requests.get(f"{crashy_url}/health", timeout=30).status_code == 200, timeout=300, interval=1.0)
    client = openai.OpenAI(base_url=f"{crashy_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert client.completions.create(model=APP, prompt="Hello", max_tokens=4).usage.completion_tokens >= 1
