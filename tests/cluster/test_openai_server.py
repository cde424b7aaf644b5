"""The OpenAI-compatible server on real Ray Serve, driven by the real `openai` client."""

from __future__ import annotations

import asyncio
import math

import requests
import openai
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.server_config import ServerConfig
from tests.cluster.conftest import deploy, metric_values, wait_until

MODEL = "tiny-llama"
MAX_MODEL_LEN = 512
APP = "openai-test"


@pytest.fixture(scope="module")
def base_url(serve_url, model_dirs):
    from ray import serve

    config = ServerConfig(model=str(model_dirs["llama"]), served_model_name=MODEL, engine={"max_model_len": MAX_MODEL_LEN})
    deploy(config, APP, "/")
    yield serve_url
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dirs):
    """The same checkpoint offline: what the server must reproduce."""
    llm = LLM(str(model_dirs["llama"]), max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


def greedy(offline: LLM, prompt, max_tokens: int = 16, **kwargs):
    """The offline completion: text, token ids and finish reason the server must reproduce (the
    random test model may well stop at EOS before max_tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)
    return offline.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def greedy_text(offline: LLM, prompt, max_tokens: int = 16) -> str:
    return greedy(offline, prompt, max_tokens).text


def engine_stats():
    from ray import serve

    return serve.get_deployment_handle("LLMServer", app_name=APP).stats.remote().result()


# ---- completions and chat ------------------------------------------------------------------


def test_completion_matches_offline(client, offline):
    response = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=16, temperature=0)
    choice, expected = response.choices[0], greedy(offline, "Hello, my name is")
    assert (choice.text, choice.finish_reason) == (expected.text, expected.finish_reason)
    assert response.object == "text_completion"
    prompt_tokens = len(offline.get_tokenizer().encode("Hello, my name is"))
    completion_tokens = len(expected.token_ids)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert response.usage.total_tokens == prompt_tokens + completion_tokens


def test_completion_prompt_lists_and_token_ids(client, offline):
    ids = offline.get_tokenizer().encode("The capital of France is")
    batch = client.completions.create(model=MODEL, prompt=["Hello", "Once upon a time"], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == greedy_text(offline, "Hello", 6)
    assert batch.choices[2].text == greedy_text(offline, "Once upon a time", 6)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == greedy_text(offline, {"prompt_token_ids": ids}, 6)


def test_streamed_completion_equals_unstreamed(client, offline):
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    expected = greedy(offline, "Once upon a time", 20)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == [expected.finish_reason]
    assert finishing[0].usage.completion_tokens == len(expected.token_ids)  # every stream carries usage


def test_chat_streamed_and_not(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12, temperature=0)
    assert response.choices[0].message.content == expected.text and response.choices[0].message.role == "assistant"
    assert response.choices[0].finish_reason == expected.finish_reason
    assert response.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_n_samples_with_seed_are_reproducible(client):
    def sample():
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story"}], n=3, seed=11, max_tokens=10, temperature=1.0
        )

    first, second = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert 3 <= first.usage.completion_tokens <= 30 and first.usage == second.usage


def test_stop_string(client, offline):
    full = greedy_text(offline, "Hello, my name is", 24)
    stop = full[6:9]
    response = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=24, temperature=0, stop=[stop])
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_logprobs(client, offline):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    expected = offline.generate("The sea", params, use_tqdm=False)[0].outputs[0]
    completion = client.completions.create(model=MODEL, prompt="The sea", max_tokens=5, temperature=0, logprobs=3).choices[0]
    assert len(completion.logprobs.tokens) == len(expected.token_ids)
    for value, top, token_id, entry in zip(
        completion.logprobs.token_logprobs, completion.logprobs.top_logprobs, expected.token_ids, expected.logprobs
    ):
        assert math.isclose(value, entry[token_id].logprob, abs_tol=1e-5)
        # OpenAI's legacy format keys the top-N by token text, so tokens that decode alike
        # (stray bytes of a random model) collapse into one key.
        offline_top = sorted((lp.logprob for lp in entry.values() if lp.rank <= 3), reverse=True)
        assert 1 <= len(top) <= 3 and all(any(math.isclose(v, o, abs_tol=1e-5) for o in offline_top) for v in top.values())
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    ).choices[0]
    for item in chat.logprobs.content:
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert item.logprob == item.top_logprobs[0].logprob  # greedy took the top token


def test_a_non_streaming_answer_past_grpcs_default_limit_arrives_whole(client, offline):
    """A non-streaming answer is one item of the replica's stream: 24 samples of 500 tokens with
    20 logprobs each pickle past gRPC's default 4 MiB, which the ingress once refused with a 503
    after the whole generation (serve_engine_client.GRPC_ANSWER_MAX_BYTES)."""
    n, max_tokens = 24, 500
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="The sea", n=n, max_tokens=max_tokens, temperature=0, logprobs=20, extra_body={"ignore_eos": True}
    )
    assert len(raw.content) > 5 * 2**20  # the answer really is past the default limit
    params = SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=20)
    expected = offline.generate("The sea", params, use_tqdm=False)[0].outputs
    choices = sorted(raw.parse().choices, key=lambda choice: choice.index)
    assert [choice.text for choice in choices] == [sample.text for sample in expected]
    assert all(len(choice.logprobs.tokens) == max_tokens for choice in choices)


def test_24_concurrent_streams(base_url, offline):
    prompts = [f"Story number {i}: once upon a time" for i in range(24)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(run_all())
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert texts == [e.outputs[0].text for e in expected]


def test_disconnect_aborts_and_frees_blocks(base_url):
    """Aborted once the client goes, and long before the request could have run to its end: the
    token count says it was cut short (time bounds alone failed on a loaded machine). Until the
    reads raced against a replica's leaving were cancelled with their caller (stream_race.py),
    the abort waited ~0.5 s for the garbage collector, and in one CI run the request reached
    its 500th token first; it now comes within tens of milliseconds."""
    before = engine_stats()
    aborted_before = before.request_success_total.get("abort", 0)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=30) as response:
        lines = response.iter_lines(decode_unicode=True)
        assert next(line for line in lines if line.startswith("data:"))
        wait_until(lambda: engine_stats().num_requests_running == 1, timeout=5)

    def freed():
        stats = engine_stats()
        return stats.request_success_total.get("abort", 0) == aborted_before + 1 and stats.kv_cache_usage_perc == 0.0

    def state() -> str:  # once a full suite run's failure said nothing more than the timeout
        stats = engine_stats()
        return (
            f"running {stats.num_requests_running}, waiting {stats.num_requests_waiting}, finished by reason "
            f"{stats.request_success_total} (aborted before: {aborted_before}), KV cache use {stats.kv_cache_usage_perc}, "
            f"tokens generated since the request {stats.generation_tokens_total - before.generation_tokens_total}"
        )

    wait_until(freed, timeout=15, what="the disconnected request aborted and its blocks freed", details=state)
    after = engine_stats()
    assert after.generation_tokens_total - before.generation_tokens_total < 500
    assert after.num_requests_running == 0


# ---- the other endpoints -------------------------------------------------------------------


def test_models_health_tokenize(client, base_url, offline):
    [model] = client.models.list().data
    assert model.id == MODEL
    assert requests.get(f"{base_url}/health", timeout=10).json() == {"status": "ok"}
    tokenizer = offline.get_tokenizer()
    tokens = requests.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "café 日本"}, timeout=10).json()
    assert tokens["tokens"] == tokenizer.encode("café 日本") and tokens["count"] == len(tokens["tokens"])
    text = requests.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}, timeout=10).json()
    assert text == {"prompt": "café 日本"}
    chat_tokens = requests.post(f"{base_url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=10).json()
    assert chat_tokens["tokens"] == tokenizer.encode("<|user|>Hi<|end|><|assistant|>", add_special_tokens=False)


def test_metrics_move(client, base_url):
    labels = (("model_name", MODEL),)
    before = metric_values(base_url)
    client.completions.create(model=MODEL, prompt="Count the stars", max_tokens=7, temperature=0)

    def moved():
        after = metric_values(base_url)
        grown = after[("pagedserve:generation_tokens_total", labels)] >= before.get(("pagedserve:generation_tokens_total", labels), 0) + 7
        done = after[("pagedserve:request_success_total", (("finished_reason", "length"), *labels))]
        return grown and done > before.get(("pagedserve:request_success_total", (("finished_reason", "length"), *labels)), 0) and after

    after = wait_until(moved, timeout=10, interval=0.3)
    assert after[("pagedserve:time_to_first_token_seconds_count", labels)] > before.get(("pagedserve:time_to_first_token_seconds_count", labels), 0)
    assert after[("pagedserve:prompt_tokens_total", labels)] > before.get(("pagedserve:prompt_tokens_total", labels), 0)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total", "prefix_cache_queries_total"):
        assert ("pagedserve:" + name, labels) in after


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"extra_body": {"bogus": 1}}, "unknown field 'bogus'"),
        ({"logprobs": 50}, "logprobs"),
        ({"prompt": [1] * (MAX_MODEL_LEN + 1)}, "max_model_len=512"),
        ({"prompt": [10**7]}, "outside the vocabulary"),
        ({"prompt": ""}, "empty"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_request_is_400(client, kwargs, fragment):
    request = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**request)
    error = info.value.body
    assert fragment in error["message"] and error["code"] == 400 and error["type"] == "BadRequestError"
    assert "Traceback" not in error["message"]


@pytest.mark.parametrize(
    "kwargs, param, fragment",
    [
        ({"stop": ["s"] * 17}, "stop", "at most 16 stop strings are allowed, got 17"),
        ({"stop": "x" * 257}, "stop", "at most 256 characters, got one of 257"),
        ({"extra_body": {"stop_token_ids": list(range(257))}}, "stop_token_ids", "at most 256 stop token ids"),
    ],
)
def test_stop_lists_over_the_caps_are_400s(client, kwargs, param, fragment):
    """Issue 19: unbounded stop lists stalled a replica; now a 400 names the field and the cap."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, **kwargs)
    assert fragment in info.value.body["message"] and info.value.body["param"] == param
    assert len(info.value.body["message"]) < 2000


def test_text_too_long_to_fit_is_a_400_before_encoding(base_url, client, offline):
    """Text past max_model_len x the longest vocabulary entry cannot fit: refused before it is
    encoded, by /tokenize too (issue 19), and by the offline engine."""
    from pagedserve.engine.tokenizer import longest_token_chars

    limit = MAX_MODEL_LEN * longest_token_chars(offline.get_tokenizer())
    text = "a" * (limit + 1)
    fragment = f"prompt: {limit + 1} characters, more than the {limit} that can fit in max_model_len={MAX_MODEL_LEN} tokens"
    response = requests.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": text}, timeout=30)
    assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text
    assert response.json()["error"]["param"] == "prompt"
    chat = requests.post(f"{base_url}/tokenize", json={"messages": [{"role": "user", "content": text}]}, timeout=30)
    assert chat.status_code == 400 and "messages: " in chat.json()["error"]["message"], chat.text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=text, max_tokens=2)
    assert fragment in info.value.body["message"] and info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=2)
    assert "messages: " in info.value.body["message"] and info.value.body["param"] == "messages"
    with pytest.raises(ValueError, match=fragment):
        offline.generate(text, SamplingParams(max_tokens=2), use_tqdm=False)
    assert requests.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "a" * 100}, timeout=30).status_code == 200


def test_malformed_json_and_unknown_model(base_url, client):
    response = requests.post(f"{base_url}/v1/chat/completions", data=b"{not json", headers={"content-type": "application/json"}, timeout=10)
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])


def test_openapi_documents_request_bodies(base_url):
    """Clients, docs and fuzzers learn the request bodies from the schema; errors are 400s in
    OpenAI's shape, never FastAPI's 422."""
    schema = requests.get(f"{base_url}/openapi.json", timeout=10).json()
    bodies = {
        "/v1/completions": "CompletionRequest",
        "/v1/chat/completions": "ChatCompletionRequest",
        "/tokenize": "TokenizeRequest",
        "/detokenize": "DetokenizeRequest",
    }
    for path, model in bodies.items():
        operation = schema["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"] == f"#/components/schemas/{model}"
        assert "422" not in operation["responses"] and "4XX" in operation["responses"]
    completion = schema["components"]["schemas"]["CompletionRequest"]
    assert {"model", "prompt"} <= set(completion["required"]) and "max_tokens" in completion["properties"]
    assert "messages" in schema["components"]["schemas"]["ChatCompletionRequest"]["required"]
    assert set(schema["components"]["schemas"]["ErrorResponse"]["properties"]) == {"error"}


def test_bad_bodies_are_openai_shaped_400s(base_url):
    post = lambda path, **kwargs: requests.post(f"{base_url}{path}", timeout=10, **kwargs)  # noqa: E731
    cases = [
        (post("/v1/completions", json=[1, 2]), "must be a JSON object"),
        (post("/v1/completions", data=b"\xff\xfe{", headers={"content-type": "application/json"}), ""),
        (post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"}), "max_tokens"),
        (post("/v1/completions", json={"prompt": "x"}), "model"),
        (post("/tokenize", json={"prompt": "x", "bogus": True}), "unknown field 'bogus'"),
        (post("/detokenize", json={"tokens": "abc"}), "tokens"),
        (post("/v1/chat/completions", json={"model": MODEL, "messages": "x" * 100_000}), "messages"),
    ]
    for response, fragment in cases:
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == 400 and fragment in error["message"], response.text
        assert len(response.text) < 2000  # a huge bad value is not echoed back
    missing = requests.get(f"{base_url}/v1/nothing-here", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"


def test_limits_follow_the_engine(client):
    """n (prompts x n for a prompt list) is capped by max_n, top_logprobs by max_logprobs."""
    cases = [
        (lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, n=129), "n=129 exceeds the limit of max_n=128", "n"),
        (lambda: client.completions.create(model=MODEL, prompt=["Hi"] * 5, max_tokens=1, n=26), "5 prompts x n=26 = 130", "n"),
        (
            lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=21),
            "top_logprobs=21 exceeds the limit of max_logprobs=20",
            "top_logprobs",
        ),
        (lambda: client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, n=0), "n", "n"),
    ]
    for call, fragment, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert fragment in info.value.body["message"] and info.value.body["param"] == param
    within = client.completions.create(model=MODEL, prompt=["Hi"] * 4, max_tokens=1, n=32, temperature=1.0)
    assert len(within.choices) == 128


def test_request_body_size_is_limited(base_url):
    """8 MiB by default (max_request_body_bytes): 413 whether the size is declared or the body
    comes in chunks, and the server answers normally afterwards."""
    big = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"a" * (9 * 1024**2) + b'"}'
    declared = requests.post(f"{base_url}/v1/completions", data=big, headers={"content-type": "application/json"}, timeout=60)
    chunked = requests.post(
        f"{base_url}/v1/completions", data=(big[i : i + 65536] for i in range(0, len(big), 65536)), headers={"content-type": "application/json"}, timeout=60
    )
    for response in (declared, chunked):
        assert response.status_code == 413 and "max_request_body_bytes=8388608" in response.json()["error"]["message"]
    assert "content-length" not in chunked.request.headers  # it really was sent in chunks
    ok = requests.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


# ---- tenant salts --------------------------------------------------------------------------


def test_cache_salt_keeps_prefix_hits_within_a_tenant(client):
    """vLLM's `cache_salt`: the same prompt under another salt finds none of the first one's
    cached blocks (its time to first token reveals nothing); under the same salt it hits."""
    text = "A tenant's private system prompt: " + " ".join(f"clause {i}." for i in range(30))

    def hits() -> int:
        return engine_stats().prefix_cache_hits_total

    def complete(salt: str | None) -> None:
        extra = {} if salt is None else {"cache_salt": salt}
        client.completions.create(model=MODEL, prompt=text, max_tokens=1, temperature=0, extra_body=extra)

    def chat(salt: str) -> None:
        messages = [{"role": "user", "content": text + " (chat)"}]
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0, extra_body={"cache_salt": salt})

    complete("tenant-a")
    chat("tenant-a")
    before = hits()
    complete("tenant-b")
    complete(None)
    chat("tenant-b")
    assert hits() == before
    complete("tenant-a")
    after_completion = hits()
    assert after_completion > before
    chat("tenant-a")
    assert hits() > after_completion
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model=MODEL, prompt=text, max_tokens=1, extra_body={"cache_salt": ""})


class _RecordingClient:
    """An EngineClient that records the prompts it is sent and answers with an error."""

    def __init__(self):
        self.prompts = []

    async def generate(self, request_id, prompt, params, resume=None):
        from pagedserve.cluster.stream_items import ErrorInfo

        self.prompts.append(prompt)
        yield ErrorInfo(400, "recorded")

    async def is_shutting_down(self) -> bool:
        return False


def test_the_api_key_salts_a_request_without_its_own_salt():
    """With API keys in use the ingress passes the key's salt; a request's cache_salt wins."""
    from pagedserve.cluster.ingress import api_key_salt, key_digest
    from pagedserve.cluster.openai_serving import APIError, OpenAIServing
    from pagedserve.cluster.protocol import ChatCompletionRequest, CompletionRequest

    assert api_key_salt("Bearer key-a") != api_key_salt("Bearer key-b")
    assert api_key_salt("Bearer key-a") == api_key_salt("bearer  key-a ")
    assert key_digest("key-a") not in api_key_salt("Bearer key-a")  # not the digest that authorizes
    recorder = _RecordingClient()
    serving = OpenAIServing(MODEL, recorder)
    salt = api_key_salt("Bearer key-a")

    async def send() -> None:
        for request in (
            CompletionRequest(model=MODEL, prompt="hi"),
            CompletionRequest(model=MODEL, prompt=[1, 2, 3], cache_salt="own"),
            ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}]),
        ):
            method = serving.chat if isinstance(request, ChatCompletionRequest) else serving.completions
            with pytest.raises(APIError, match="recorded"):
                await method(request, salt)

    asyncio.run(send())
    assert [p["cache_salt"] for p in recorder.prompts] == [salt, "own", salt]
    assert recorder.prompts[0]["prompt"] == "hi" and recorder.prompts[1]["prompt_token_ids"] == [1, 2, 3]
    assert recorder.prompts[2]["messages"] == [{"role": "user", "content": "hi"}]


def test_forced_tool_call_is_plain_json_without_a_tool_parser(client, offline):
    """This server names no --tool-call-parser and the template has no tool format (the demo's
    case): a forced call is written as plain JSON, equal to the offline engine's under the same
    schema; "auto" needs the server's flags (docs/structured-outputs.md)."""
    import json

    from pagedserve import StructuredOutputsParams
    from pagedserve.engine.chat import render_chat

    parameters = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    messages = [{"role": "user", "content": "Weather?"}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=80, temperature=0, tools=tools, tool_choice="required")
    assert reply.choices[0].message.tool_calls is not None, reply.choices[0]
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]},
              "arguments": parameters}, "required": ["name", "arguments"], "additionalProperties": False}}
    prompt = render_chat(offline.get_tokenizer(), messages, None, True, tools)
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=schema))
    text = offline.generate({"prompt_token_ids": prompt["prompt_token_ids"]}, params, use_tqdm=False)[0].outputs[0].text
    assert json.loads(text) == [{"name": "get_weather", "arguments": json.loads(call.function.arguments)}]
    with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, tools=tools)
