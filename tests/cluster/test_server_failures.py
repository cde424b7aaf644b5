"""The server's refusals: a missing or wrong API key (401), an overloaded deployment or engine
(503 with Retry-After), and an engine whose workers died and could not be rebuilt (503, /health
too); the API key's delivery (never in the app's arguments or the logs)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
from pathlib import Path

import openai
import pytest
import requests

from pagedserve.cli import main
from pagedserve.cluster.app import build_app
from pagedserve.cluster.server_config import ServerConfig
from tests.cluster.conftest import deploy

KEY = "sk-test-" + secrets.token_hex(12)  # unique, so a search of the logs means something


@pytest.fixture(scope="module")
def keyed_url(serve_url, model_dirs, ray_cluster):
    """The key set in this (the launching) process's environment only, as `pagedserve serve`
    against an existing cluster has it; one running and one waiting engine request; room for
    four requests at the replica plus one queued."""
    from ray import cloudpickle, serve

    config = ServerConfig(
        model=str(model_dirs["llama"]),
        served_model_name="keyed",
        engine={"max_model_len": 512, "max_num_seqs": 1, "max_waiting_requests": 1},
        deployment={"max_ongoing_requests": 4, "max_queued_requests": 1},
    )
    os.environ["PAGEDSERVE_API_KEY"] = KEY
    try:
        app = build_app(config)
    finally:
        del os.environ["PAGEDSERVE_API_KEY"]
    # The Ray processes (the ingress replica's among them) do not have it.
    assert ray_cluster.get(ray_cluster.remote(lambda: os.environ.get("PAGEDSERVE_API_KEY")).remote()) is None
    assert KEY.encode() not in cloudpickle.dumps(app)  # nor does anything Serve is given and records
    serve.run(app, name="keyed", route_prefix="/keyed")
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
    # A client without the key learns nothing about the body it sent.
    unauthorized = requests.post(f"{keyed_url}/v1/completions", data=b"{not json", timeout=10)
    assert unauthorized.status_code == 401


def test_api_key_is_in_no_log(keyed_url, ray_cluster):
    logs = Path(ray_cluster._private.worker._global_node.get_session_dir_path()) / "logs"
    files = [path for path in logs.rglob("*") if path.is_file()]
    assert files and not [path for path in files if KEY.encode() in path.read_bytes()]


def test_api_key_file(tmp_path, capsys):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    assert ServerConfig(api_key_file=str(key_file)).resolve_api_key() == KEY
    key_file.write_text("  \n")
    with pytest.raises(ValueError, match=f"api_key_file '{key_file}' is empty"):
        build_app(ServerConfig(api_key_file=str(key_file)))
    # The command refuses to start (before it starts Ray) rather than serve without the key.
    missing = tmp_path / "nowhere"
    assert main(["serve", "--api-key-file", str(missing)]) == 2
    assert f"cannot read api_key_file '{missing}'" in capsys.readouterr().err


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
            assert error.response.headers["retry-after"] == "1"
            return error.status_code

    async def burst() -> list[int]:
        async with openai.AsyncOpenAI(base_url=f"{keyed_url}/v1", api_key=KEY, max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client) for _ in range(6)))

    # Six at once, room for five (four at the replica, one queued): Serve or the engine (one
    # running, one waiting) refuses some, each with Retry-After.
    statuses = asyncio.run(burst())
    assert statuses.count(503) >= 1 and statuses.count(200) >= 1, statuses
    assert set(statuses) <= {200, 503}


def test_engine_admission_counts_samples(keyed_url):
    """max_waiting_requests=1 counts engine requests: one request of n=2 is two of them."""
    client = openai.OpenAI(base_url=f"{keyed_url}/v1", api_key=KEY, max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="keyed", prompt="Hello", max_tokens=2, n=2)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
    assert "max_waiting_requests=1" in info.value.body["message"]
    assert client.completions.create(model="keyed", prompt="Hello", max_tokens=2).usage.completion_tokens >= 1


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
