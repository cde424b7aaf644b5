"""A `serve deploy` that changes the app's `args` mid-stream: Serve hashes the args into the
app's code version, so every deployment gets a new version, the ingress included. The old
ingress replica holds the clients' connections: it must stay until its streams end while the
LLMServer replicas under it are replaced one by one (its streams move to old replicas that stay,
then to new ones), and the new ingress must run before the old one stops taking requests.

Long streams (1000 tokens of the built-in tiny model) so that they outlive the old ingress's stop by far more than Serve's
default grace (20 s, which cut them before); the same mix as test_drain.py (greedy and seeded,
completions and chat, n=1 and n=2, streams and whole requests)."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.cluster.test_drain import APP, JSON_STREAMS, NUM_STREAMS, apply, one, replica_states, run_all

MODEL = "tiny"  # the built-in 4-layer model: 2048 positions, so streams can be long
ENGINE = {"max_model_len": 2048}
MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def long_url(serve_url):
    from ray import serve

    apply(MODEL, 2, engine=ENGINE)
    yield f"{serve_url}/{APP}"
    if APP in serve.status().applications:  # the last test deletes it itself
        serve.delete(APP)


def test_redeploy_with_changed_args_mid_stream_hands_streams_over(long_url):
    undisturbed = asyncio.run(run_all(long_url, max_tokens=MAX_TOKENS))
    num_in_flight_at_ingress_stop = 0

    def redeploy(in_flight) -> int:
        def in_flight_now() -> int:
            nonlocal num_in_flight_at_ingress_stop
            num = in_flight()
            if "STOPPING" in replica_states("OpenAIIngress"):
                num_in_flight_at_ingress_stop = max(num_in_flight_at_ingress_stop, num)
            return num

        return apply(MODEL, 2, in_flight_now, engine={**ENGINE, "max_num_seqs": 64})

    results = asyncio.run(run_all(long_url, redeploy, max_tokens=MAX_TOKENS))
    assert results == undisturbed  # text of every choice, prompt and completion tokens
    assert num_in_flight_at_ingress_stop >= NUM_STREAMS // 2, "the old ingress stopped with no streams through it"


def test_delete_mid_stream_ends_streams_where_they_are(long_url):
    """Deleting the app leaves nowhere to move to: each stream finishes on its replica, or ends
    with a 503 error event when the replica's grace period (2 s) runs out first; none hangs
    waiting for a replica (the old ingress's long grace would keep the delete waiting), and no
    connection is cut."""
    from ray import serve

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{long_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
            started = [asyncio.Event() for _ in range(4)]
            calls = [asyncio.ensure_future(one(client, i, event, MAX_TOKENS)) for i, event in enumerate(started)]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=180)
            await asyncio.to_thread(serve.delete, APP)
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), timeout=120)

    for i, result in enumerate(asyncio.run(run())):
        if isinstance(result, BaseException):
            assert isinstance(result, openai.APIError) and "stopped" in str(result), repr(result)
        elif i in JSON_STREAMS:  # done when its array is: 480 tokens at most, and fewer in a fast step
            assert all(len(json.loads(text)) == 100 for text in result[0]), result[0]
        else:
            assert result[2] == MAX_TOKENS
