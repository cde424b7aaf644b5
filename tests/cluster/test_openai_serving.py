"""OpenAIServing alone, against a fake engine client (no Ray, no Serve, no HTTP): completions and
chat, streaming and not, n > 1 and several prompts, the per-request limits, and engine refusals
mapped onto OpenAI's error bodies. The same paths through a live Serve app are
test_openai_server.py's."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedserve.cluster import openai_serving
from pagedserve.cluster.openai_serving import APIError, OpenAIServing, RequestLimits
from pagedserve.cluster.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.engine.request_output import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind

ErrorInfo = openai_serving.ErrorInfo  # wherever the cluster keeps it, the type OpenAIServing reads
PROMPT_IDS = [5, 6, 7]


def output(*choices: tuple[int, str, list[int], str | None], finished: bool = True) -> RequestOutput:
    """One engine item: (choice index, text, token ids, finish reason) per choice."""
    completions = [CompletionOutput(index, text, ids, finish_reason=reason) for index, text, ids, reason in choices]
    return RequestOutput("engine-id", None, PROMPT_IDS, completions, finished)


class FakeEngine:
    """An EngineClient that answers the i-th call with scripts[i] (items, or one ErrorInfo), and
    records each call's prompt and params and whether its stream was closed."""

    def __init__(self, *scripts: list):
        self.scripts = list(scripts)
        self.calls: list[dict] = []

    async def generate(self, request_id, prompt, params, resume=None):
        call = {"request_id": request_id, "prompt": prompt, "params": params, "is_closed": False}
        script = self.scripts[len(self.calls)]
        self.calls.append(call)
        try:
            for item in script:
                if item == "hang":
                    await asyncio.Event().wait()  # a stream that stays open until closed
                if item == "fail":
                    raise RuntimeError("the engine call failed")
                yield item
        finally:
            call["is_closed"] = True


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=30))


def serve(engine: FakeEngine, request, limits: RequestLimits = RequestLimits(), renderer=None):
    """The endpoint's answer: a body, or the parsed SSE events (dicts, and '[DONE]')."""
    serving = OpenAIServing("my-model", engine, limits, renderer)

    async def call():
        endpoint = serving.chat if isinstance(request, ChatCompletionRequest) else serving.completions
        result = await endpoint(request)
        if isinstance(result, dict):
            return result
        events = []
        async for event in result:
            assert event.startswith("data: ") and event.endswith("\n\n")
            data = event[len("data: "):-2]
            events.append(data if data == "[DONE]" else json.loads(data))
        return events

    return run(call())


def completion(**fields) -> CompletionRequest:
    return CompletionRequest(model="my-model", **{"prompt": "Hello", "max_tokens": 5, **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="my-model", **{"messages": [{"role": "user", "content": "Hi"}], **fields})


# ---- completions ------------------------------------------------------------------------------


def test_completion_body_and_what_the_engine_is_asked():
    engine = FakeEngine([output((0, " world", [11, 12], "length"))])
    body = serve(engine, completion(temperature=0.0, seed=3))
    assert body["object"] == "text_completion" and body["model"] == "my-model"
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": " world", "logprobs": None, "finish_reason": "length", "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    [call] = engine.calls
    assert call["prompt"] == "Hello"
    params = call["params"]
    assert (params.max_tokens, params.temperature, params.seed, params.n) == (5, 0.0, 3, 1)
    assert params.output_kind == RequestOutputKind.FINAL_ONLY  # one final item per prompt


def test_completion_of_two_prompts_with_n_2_numbers_choices_prompt_by_prompt():
    engine = FakeEngine(
        [output((0, "a", [1], "length"), (1, "b", [2, 3], "stop"))],
        [output((1, "d", [4], "length"), (0, "c", [5], "length"))],
    )
    body = serve(engine, completion(prompt=[[1, 2], [9, 8]], n=2))
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a"), (1, "b"), (3, "d"), (2, "c")]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    assert [call["prompt"] for call in engine.calls] == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [9, 8]}]
    assert len({call["request_id"] for call in engine.calls}) == 2  # one engine request per prompt


def test_completion_stream_events_usage_and_done():
    engine = FakeEngine([
        output((0, "Hel", [1], None), finished=False),
        output((0, "lo", [2], "length")),
    ])
    events = serve(engine, completion(stream=True, stream_options={"include_usage": True}))
    assert engine.calls[0]["params"].output_kind == RequestOutputKind.DELTA
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert [c["choices"][0]["text"] for c in chunks] == ["Hel", "lo"]
    assert {c["object"] for c in events[:-1]} == {"text_completion"} and len({c["id"] for c in events[:-1]}) == 1
    assert "usage" not in chunks[0]  # a chunk that finishes a choice carries the usage so far
    assert chunks[1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 2


def test_completion_stream_without_include_usage_has_no_usage_only_chunk():
    engine = FakeEngine([output((0, "x", [1], "stop"))])
    events = serve(engine, completion(stream=True))
    assert len(events) == 2 and events[0]["choices"][0]["finish_reason"] == "stop" and events[1] == "[DONE]"


def test_an_error_in_the_middle_of_a_stream_is_an_openai_error_event():
    engine = FakeEngine([output((0, "Hel", [1], None), finished=False), ErrorInfo(503, "the replica died", "ServiceUnavailableError")])
    events = serve(engine, completion(stream=True))
    assert events[0]["choices"][0]["text"] == "Hel"
    assert events[1] == {"error": {"message": "the replica died", "type": "ServiceUnavailableError", "code": 503, "param": None}}
    assert events[2] == "[DONE]"


# ---- chat -------------------------------------------------------------------------------------


def test_chat_body_and_the_prompt_sent_as_messages():
    engine = FakeEngine([output((0, "Hi there", [3, 4], "stop"))])
    request = chat(messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                   max_completion_tokens=7)
    body = serve(engine, request)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 2
    [call] = engine.calls
    assert call["prompt"] == {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                              "add_generation_prompt": True}
    assert call["params"].max_tokens == 7


def test_chat_stream_with_n_2_sends_the_role_once_per_choice():
    engine = FakeEngine([
        output((0, "A", [1], None), (1, "B", [2], None), finished=False),
        output((1, "b", [3], "length"), finished=False),
        output((0, "a", [4], "length")),
    ])
    events = serve(engine, chat(stream=True, n=2))
    chunks = events[:-1]
    assert events[-1] == "[DONE]" and {c["object"] for c in chunks} == {"chat.completion.chunk"}
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks]
    assert deltas == [(0, {"content": "A", "role": "assistant"}), (1, {"content": "B", "role": "assistant"}),
                      (1, {"content": "b"}), (0, {"content": "a"})]
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_a_renderer_turns_prompts_into_tokens_before_they_are_sent():
    class Renderer:
        async def render(self, prompt):
            if isinstance(prompt, dict) and prompt["messages"][0]["content"] == "bad":
                raise ValueError("cannot apply the chat template: nope")
            return {"prompt": "rendered", "prompt_token_ids": [1, 2]}

    engine = FakeEngine([output((0, "ok", [3], "stop"))])
    serve(engine, chat(), renderer=Renderer())
    assert engine.calls[0]["prompt"] == {"prompt": "rendered", "prompt_token_ids": [1, 2]}
    with pytest.raises(APIError) as raised:
        serve(FakeEngine(), chat(messages=[{"role": "user", "content": "bad"}]), renderer=Renderer())
    assert raised.value.status == 400 and "chat template" in raised.value.message


# ---- errors -----------------------------------------------------------------------------------


def test_an_engine_refusal_is_an_openai_error_with_retry_after():
    engine = FakeEngine([ErrorInfo(503, "overloaded: 4096 requests waiting", "ServiceUnavailableError", retry_after_s=1)])
    with pytest.raises(APIError) as raised:
        serve(engine, completion())
    error = raised.value
    assert (error.status, error.retry_after_s) == (503, 1)
    assert error.body() == {"error": {"message": "overloaded: 4096 requests waiting", "type": "ServiceUnavailableError", "code": 503, "param": None}}


def test_a_refusal_of_one_prompt_closes_the_other_prompts_streams():
    engine = FakeEngine([output((0, "fine", [1], None), finished=False), "hang"], [ErrorInfo(400, "prompt too long", param="prompt")])
    with pytest.raises(APIError) as raised:
        serve(engine, completion(prompt=["short", "long"], stream=True))
    assert raised.value.body()["error"] == {"message": "prompt too long", "type": "BadRequestError", "code": 400, "param": "prompt"}
    assert [call["is_closed"] for call in engine.calls] == [True, True]


def test_a_failed_first_read_closes_the_other_prompts_streams_at_once():
    """Checked before the event loop ends (its shutdown would close them anyway): a stream whose
    first read was still running could not be closed, and was left to the garbage collector."""
    engine = FakeEngine(["hang"], ["fail"])

    async def call():
        with pytest.raises(RuntimeError, match="the engine call failed"):
            await OpenAIServing("my-model", engine, RequestLimits()).completions(completion(prompt=["a", "b"]))
        return [call["is_closed"] for call in engine.calls]

    assert run(call()) == [True, True]


@pytest.mark.parametrize(
    ("request_", "param", "words"),
    [
        (completion(prompt=["a", "b", "c"], n=50), "n", "3 prompts x n=50 = 150 exceeds the limit of max_n=128"),
        (completion(logprobs=21), "logprobs", "logprobs=21 exceeds the limit of max_logprobs=20"),
        (chat(logprobs=True, top_logprobs=30), "top_logprobs", "top_logprobs=30 exceeds the limit of max_logprobs=20"),
        (completion(temperature=-1.0), "temperature", "temperature"),
        (completion(prompt=[]), "prompt", "must not be an empty list"),
    ],
    ids=["n", "logprobs", "top_logprobs", "temperature", "empty_prompt"],
)
def test_bad_values_are_400s_naming_the_field_and_reach_no_engine(request_, param, words):
    engine = FakeEngine()
    with pytest.raises(APIError) as raised:
        serve(engine, request_)
    body = raised.value.body()["error"]
    assert (raised.value.status, body["code"], body["type"], body["param"]) == (400, 400, "BadRequestError", param)
    assert words in body["message"]
    assert engine.calls == []


def test_limits_follow_the_engine_settings():
    engine = FakeEngine([output((0, "a", [1], "stop"), (1, "b", [2], "stop"))])
    assert len(serve(engine, completion(n=2), RequestLimits(max_n=2))["choices"]) == 2
    with pytest.raises(APIError, match="max_n=1 "):
        serve(FakeEngine(), completion(n=2), RequestLimits(max_n=1))


def test_an_aborted_whole_request_is_a_503():
    engine = FakeEngine([output((0, "part", [1], "abort"))])
    with pytest.raises(APIError) as raised:
        serve(engine, completion())
    assert raised.value.status == 503 and raised.value.type == "ServiceUnavailableError"


GRAMMAR_FAILURE = "structured outputs: StructuredOutputsParams.json: the grammar did not compile within 30 s"


def failed(error: str) -> RequestOutput:
    """The engine's final item for a request whose own input failed once running."""
    return RequestOutput("engine-id", None, PROMPT_IDS, [CompletionOutput(0, "", [], finish_reason="error", error=error)], True)


@pytest.mark.parametrize("request_body, field", [
    (chat(response_format={"type": "json_object"}), "response_format"),
    (completion(structured_outputs={"regex": "[a-z]+"}), "structured_outputs"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], tool_choice="required"), "tools"),
])
def test_a_grammar_that_failed_late_is_a_400_naming_its_field(request_body, field):
    with pytest.raises(APIError) as raised:
        serve(FakeEngine([failed(GRAMMAR_FAILURE)]), request_body)
    assert (raised.value.status, raised.value.param, raised.value.message) == (400, field, GRAMMAR_FAILURE)


def test_a_streamed_request_whose_grammar_failed_late_gets_an_error_event():
    events = serve(FakeEngine([output((0, "", [], None), finished=False), failed(GRAMMAR_FAILURE)]),
                   chat(response_format={"type": "json_object"}, stream=True))
    assert events[-1] == "[DONE]"  # as vLLM ends a stream after an error event
    assert events[-2]["error"]["message"] == GRAMMAR_FAILURE and events[-2]["error"]["param"] == "response_format"


def test_another_late_failure_is_a_400_with_its_reason():
    with pytest.raises(APIError) as raised:
        serve(FakeEngine([failed("the request is too large to send to the workers")]), completion())
    assert (raised.value.status, raised.value.param) == (400, None) and "too large" in raised.value.message
