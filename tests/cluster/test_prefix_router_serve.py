"""Prefix-aware routing on real Ray Serve: two LLMServer replicas, the real openai client.

Where requests landed is read from each replica's own prefix-cache counters in /metrics (one
series per replica), not from timing."""

from __future__ import annotations

import asyncio
import os

import openai
import pytest
import requests

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.server_config import ServerConfig
from tests.cluster.conftest import deploy, metric_per_replica, wait_until

MODEL = "tiny-routed"
APP = "prefix-router-test"
ROUTE = "/routed"
MAX_MODEL_LEN = 512
SYSTEM = "You are a careful assistant. " * 12  # well over ten KV blocks of shared prefix
USERS = ["What is a cat?", "Name a river.", "Count to three.", "Say hello.", "Why is the sky blue?", "Pick a color."]


@pytest.fixture(scope="module")
def base_url(serve_url, model_dirs):
    from ray import serve

    config = ServerConfig(
        model=str(model_dirs["llama"]),
        served_model_name=MODEL,
        engine={"max_model_len": MAX_MODEL_LEN},
        # imbalanced_threshold 2: a burst of long streams must spill over to the other replica.
        deployment={"num_replicas": 2, "routing_stats_period_s": 0.5, "imbalanced_threshold": 2},
    )
    assert config.deployment.resolved_request_router(config.engine_config().enable_prefix_caching) == "prefix_aware"
    deploy(config, APP, ROUTE)
    yield f"{serve_url}{ROUTE}"
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(model_dirs):
    llm = LLM(str(model_dirs["llama"]), max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


def per_replica(base_url: str, name: str) -> dict[str, float]:
    return metric_per_replica(base_url, name, MODEL)


def queries_settled(base_url: str, total: float) -> dict[str, float] | None:
    """Per-replica prefix-cache queries once they add up to `total` (the hub is updated every second)."""
    queries = per_replica(base_url, "pagedserve:prefix_cache_queries_total")
    return queries if sum(queries.values()) >= total else None


def test_a_shared_prefix_stays_on_one_replica_and_outputs_are_unchanged(client, base_url, offline):
    """Chats sharing a long system prompt, one after another: every one lands on the replica
    that holds the prefix (the other replica computes none of them), and each reply is the
    offline greedy reply (tokenized and templated in the ingress, as the engine would)."""
    wait_until(lambda: len(per_replica(base_url, "pagedserve:num_requests_running")) == 2, 60, what="both replicas reporting")
    num_prompt_tokens, prompts = 0, []
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    for user in USERS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        expected = offline.chat(messages, greedy, use_tqdm=False)[0]
        assert reply.choices[0].message.content == expected.outputs[0].text
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
        num_prompt_tokens += len(expected.prompt_token_ids)
        prompts.append(expected.prompt_token_ids)
    shared = len(os.path.commonprefix(prompts)) // 16 * 16  # the shared prefix's full blocks
    queries = wait_until(lambda: queries_settled(base_url, num_prompt_tokens), 30, what="the replicas' stats")
    hits = per_replica(base_url, "pagedserve:prefix_cache_hits_total")
    assert sorted(queries.values()) == [0, num_prompt_tokens], queries  # one replica served every chat
    assert sum(hits.values()) >= (len(USERS) - 1) * shared, hits  # each later chat hit the shared prefix


def test_a_burst_on_one_prefix_spills_over_when_imbalanced(client, base_url):
    """Long streams that share a prefix arrive one after another, each while the earlier ones
    still run (200 tokens each): once the replica holding the prefix runs more than
    imbalanced_threshold (2) requests beyond the other, the rest go to the other replica.

    Each stream starts once the previous one has text, so the router has counted it (a router
    counts a request once its replica accepted it). Sent all at once, the eight were chosen in
    an order that depends on timing, and one full run saw all eight on one replica."""
    before = per_replica(base_url, "pagedserve:prefix_cache_queries_total")
    prompt = "Once upon a time in a land far away, " * 10
    async_client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def stream(i: int, started: asyncio.Event) -> int:
        chunks = await async_client.completions.create(
            model=MODEL, prompt=prompt + str(i), max_tokens=200, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        num_with_text = 0
        async for chunk in chunks:
            if chunk.choices and chunk.choices[0].text:
                num_with_text += 1
                started.set()
        started.set()  # none had text: the assertion below says so
        return num_with_text

    async def burst() -> list[int]:
        calls = []
        for i in range(8):
            started = asyncio.Event()
            calls.append(asyncio.ensure_future(stream(i, started)))
            await asyncio.wait_for(started.wait(), timeout=60)
        return await asyncio.gather(*calls)

    assert all(num > 0 for num in asyncio.run(burst()))
    num_prompt_tokens = 8 * len(requests.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": prompt + "0"}, timeout=30).json()["tokens"])
    total = sum(before.values()) + num_prompt_tokens * 0.9  # the suffixes' lengths differ a little
    queries = wait_until(lambda: queries_settled(base_url, total), 30, what="the replicas' stats")
    grew = [queries[replica] - before.get(replica, 0) for replica in queries]
    assert len(grew) == 2 and min(grew) > 0, (before, queries)  # both replicas took part of the burst


def test_ingress_tokenization_errors_stay_400s(client):
    """The ingress templates and tokenizes now; a conversation too long for the engine is still
    the engine's clear 400, and the server goes on serving."""
    too_long = [{"role": "user", "content": "word " * (2 * MAX_MODEL_LEN)}]
    with pytest.raises(openai.BadRequestError, match="max_model_len=512"):
        client.chat.completions.create(model=MODEL, messages=too_long, max_tokens=4)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.usage.completion_tokens >= 1
