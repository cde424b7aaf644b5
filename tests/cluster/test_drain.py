"""A drain that hands streams over (cluster/handover.py): when an LLMServer replica is removed
mid-stream (a downscale, a redeploy), every stream and every whole request in flight finishes on
another replica, equal to an undisturbed run, with no error, no gap and no repeated text.

Two replicas of the tiny Llama, a short grace period (2 s: a stream left on a stopping replica
would be cut), greedy and seeded sampling, streams of one choice and of two (n=2: each choice
resumes from what the client has of it), two streams under a JSON schema (the longest, so they
are mid-JSON when their replica leaves: the grammar goes on where it was), the real openai
client."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.cluster.conftest import wait_until
from tests.cluster.openai_requests import ask

APP = "drainy"
NUM_STREAMS = 8
MAX_TOKENS = 200  # long enough to be in flight when the replica leaves
PROMPTS = ["Once upon a time", "The capital of France is", "Hello, my name is", "In a hole in the ground"]
JSON_STREAMS = (2, 5)  # greedy chat; seeded completions with n=2
LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 100, "maxItems": 100}


def apply(
    model_dir, num_replicas: int, in_flight=lambda: 0, version: str = "1", engine: dict | None = None, is_change: bool = True
) -> int:
    """Deploy through Serve's declarative config (what `serve deploy` and KubeRay's REST PUT
    send): a change of `deployments:`' num_replicas alone scales; a change of its actor options
    (here an environment variable naming the `version`) makes a new LLMServer version; a change
    of the app's `args` (`engine` arguments) makes a new version of every deployment.
    Returns once the application runs with that many LLMServer replicas and no others, and the
    most requests `in_flight()` counted while the replicas changed (a redeploy stops one old
    replica while it starts a new one, then the other once the new one runs; one snapshot at the
    first change could fall between two waves of requests). A change (`is_change`) is waited
    for until the replicas were seen to change: Serve's status lags the deploy call a little."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    args = {"model": str(model_dir), "served_model_name": APP, "graceful_shutdown_s": 2.0, "engine": {"max_model_len": 512, **(engine or {})}}
    server = {"name": "LLMServer", "num_replicas": num_replicas,
              "ray_actor_options": {"num_cpus": 1, "runtime_env": {"env_vars": {"DRAIN_TEST_VERSION": version}}}}
    app = {"name": APP, "route_prefix": f"/{APP}", "import_path": "pagedserve.cluster.app:build_app", "args": args, "deployments": [server]}
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate({"applications": [app]}))
    before = replica_states("LLMServer")
    num_in_flight = None

    def settled() -> bool:
        nonlocal num_in_flight
        app = app_status()
        states = replica_states("LLMServer", app)
        if num_in_flight is not None or states != before:
            num_in_flight = max(num_in_flight or 0, in_flight())
        is_running = app is not None and app.status == "RUNNING" and states == {"RUNNING": num_replicas}
        return is_running and (num_in_flight is not None or not is_change)

    wait_until(settled, timeout=300, interval=0.1, what=f"{num_replicas} LLMServer replicas", details=lambda: str(app_status()))
    return num_in_flight or 0


def app_status():
    from ray import serve

    return serve.status().applications.get(APP)


def replica_states(deployment: str, app=None) -> dict[str, int]:
    """A deployment's replicas by state, whatever the application's status (`app`: one read
    of it, else read now)."""
    app = app or app_status()
    if app is None or deployment not in app.deployments:
        return {}
    states = app.deployments[deployment].replica_states.items()
    return {str(state.value if hasattr(state, "value") else state): n for state, n in states if n}


def sampling(i: int) -> dict:
    """Half greedy, half seeded sampling; completions and chat alternate; the last three
    streams ask for two choices each (which move choice by choice)."""
    n = {"n": 2} if i >= NUM_STREAMS - 3 else {}
    if i % 2 == 0:
        return {"temperature": 0.0, **n}
    # No top_p: a resumed request runs in another batch, whose logits round ~1e-6 apart, and a
    # nucleus edge can turn that into another draw (tests/engine/test_resume.py).
    return {"temperature": 1.0, "seed": 100 + i, "frequency_penalty": 0.3, **n}


async def one(client: openai.AsyncOpenAI, i: int, started: asyncio.Event | None, max_tokens: int) -> tuple:
    """(each choice's text, prompt_tokens, completion_tokens) of request i; streamed unless
    `started` is None."""
    params = {"max_tokens": max_tokens, "extra_body": {"ignore_eos": True}, **sampling(i)}
    if started is not None and i in JSON_STREAMS:  # ends with its array, after the others
        params = {**params, "max_tokens": 480, "extra_body": {"structured_outputs": {"json": LONG_ARRAY}}}
    return await ask(client, APP, PROMPTS[i % len(PROMPTS)], i % 4 >= 2, params, started)


async def run_all(base_url: str, disturb=None, calls: list | None = None, max_tokens: int = MAX_TOKENS) -> list[tuple]:
    """NUM_STREAMS streams and two whole requests (their futures also go into `calls`).
    `disturb(in_flight)` runs (in a thread) once every stream has text; it returns how many
    requests were in flight when the replicas first changed: most of them, or the test tests
    nothing."""
    calls = [] if calls is None else calls
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        started = [asyncio.Event() for _ in range(NUM_STREAMS)]
        calls += [asyncio.ensure_future(one(client, i, event, max_tokens)) for i, event in enumerate(started)]
        calls += [asyncio.ensure_future(one(client, i, None, max_tokens)) for i in range(2)]
        if disturb is None:
            return await asyncio.wait_for(asyncio.gather(*calls), timeout=600)
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=180)
        num_in_flight = await asyncio.to_thread(disturb, lambda: sum(not call.done() for call in calls))
        results = await asyncio.wait_for(asyncio.gather(*calls), timeout=600)  # a failed request raises here
        assert num_in_flight >= NUM_STREAMS // 2, f"only {num_in_flight} requests were in flight when a replica left"
        return results


async def run_waves(base_url: str, change) -> tuple[list[list[tuple]], int]:
    """Waves of run_all, one after another, for as long as `change(in_flight)` runs in a thread
    (a redeploy first builds the application, for a time no test can know): the waves' results,
    and the most requests in flight while the replicas changed."""
    calls: list = []
    changing = asyncio.ensure_future(asyncio.to_thread(change, lambda: sum(not call.done() for call in calls)))
    waves = []
    while not changing.done():
        calls.clear()
        waves.append(await run_all(base_url, calls=calls))
    return waves, await changing


@pytest.fixture(scope="module")
def drain_url(serve_url, model_dirs):
    from ray import serve

    apply(model_dirs["llama"], 2)
    yield f"{serve_url}/{APP}"
    serve.delete(APP)


@pytest.fixture(scope="module")
def undisturbed(drain_url):
    results = asyncio.run(run_all(drain_url))
    for i in JSON_STREAMS:
        texts, _, num_tokens = results[i]
        assert num_tokens / len(texts) > MAX_TOKENS and all(len(json.loads(text)) == 100 for text in texts)
    return results


def test_scale_down_mid_stream_hands_streams_over(drain_url, undisturbed, model_dirs):
    results = asyncio.run(run_all(drain_url, lambda in_flight: apply(model_dirs["llama"], 1, in_flight)))
    assert results == undisturbed  # text, prompt and completion tokens: as if undisturbed


def test_redeploy_mid_stream_hands_streams_over(drain_url, undisturbed, model_dirs):
    """A new LLMServer version (changed actor options) replaces both replicas mid-stream:
    Serve stops one old replica while it starts a new one, then the other old one once the new
    one runs; requests keep coming throughout."""
    apply(model_dirs["llama"], 2, is_change=False)  # after the scale-down test, or already
    redeploy = lambda in_flight: apply(model_dirs["llama"], 2, in_flight, version="2")  # noqa: E731
    waves, num_in_flight = asyncio.run(run_waves(drain_url, redeploy))
    assert num_in_flight >= 1, "no request was in flight while the replicas changed"
    assert waves and all(results == undisturbed for results in waves)
