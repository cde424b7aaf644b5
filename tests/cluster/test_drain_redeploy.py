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

import pytest

from tests.cluster.test_drain import APP, NUM_STREAMS, apply, replica_states, run_all

MODEL = "tiny"  # the built-in 4-layer model: 2048 positions, so streams can be long
ENGINE = {"max_model_len": 2048}
MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def long_url(serve_url):
    from ray import serve

    apply(MODEL, 2, engine=ENGINE)
    yield f"{serve_url}/{APP}"
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
