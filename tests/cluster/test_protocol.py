"""OpenAI request bodies: validation and the mapping onto SamplingParams (no server needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedserve.cluster.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from pagedserve.sampling_params import RequestOutputKind


def test_completion_fields_map_onto_sampling_params():
    request = CompletionRequest(
        model="m", prompt="hi", max_tokens=7, temperature=0.5, top_p=0.9, n=2, stop="x", seed=3, logprobs=2,
        presence_penalty=0.1, frequency_penalty=0.2, top_k=5, min_p=0.05, repetition_penalty=1.1, ignore_eos=True,
        min_tokens=1, stop_token_ids=[4], skip_special_tokens=False, stream=True,
    )
    params = request.sampling_params(request.max_tokens, request.logprobs)
    assert (params.max_tokens, params.temperature, params.top_p, params.n, params.stop, params.seed) == (7, 0.5, 0.9, 2, ["x"], 3)
    assert (params.top_k, params.min_p, params.repetition_penalty, params.logprobs) == (5, 0.05, 1.1, 2)
    assert (params.ignore_eos, params.min_tokens, params.stop_token_ids, params.skip_special_tokens) == (True, 1, [4], False)
    assert params.output_kind == RequestOutputKind.DELTA
    unstreamed = CompletionRequest(model="m", prompt="hi").sampling_params(16, None)
    assert unstreamed.output_kind == RequestOutputKind.FINAL_ONLY and unstreamed.temperature == 1.0


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("text", ["text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [{"prompt_token_ids": [1, 2, 3]}]),
        ([[1, 2], [3]], [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]),
    ],
)
def test_prompt_forms(prompt, expected):
    assert CompletionRequest(model="m", prompt=prompt).prompts() == expected


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "logit_bias": {"1": "2"}}, "logit_bias"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "bogus": 1}, "bogus"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),  # the upper limit is the engine's (RequestLimits)
        ({"prompt": "x", "n": 0}, "n"),
        ({}, "prompt"),
    ],
)
def test_bad_completion_bodies(body, fragment):
    with pytest.raises(ValidationError, match=fragment):
        CompletionRequest(model="m", **body)


def test_chat_fields():
    request = ChatCompletionRequest(
        model="m",
        messages=[{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=3,
    )
    assert request.max_output_tokens == 9 and request.num_logprobs == 3
    assert request.messages[0].as_template_message() == {"role": "system", "content": "ab"}
    assert ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], logprobs=True).num_logprobs == 0
    for bad, fragment in (
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "tool_call_id"),
        ({"messages": [{"role": "function", "content": "x"}]}, "role"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs requires logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
    ):
        with pytest.raises(ValidationError, match=fragment):
            ChatCompletionRequest(model="m", **bad)


def test_tokenize_needs_exactly_one_input():
    with pytest.raises(ValidationError, match="exactly one"):
        TokenizeRequest(prompt="x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(ValidationError, match="exactly one"):
        TokenizeRequest()


def test_request_limits():
    from pagedserve.cluster.openai_serving import APIError, RequestLimits

    limits = RequestLimits(max_n=8, max_logprobs=5)
    limits.check(num_prompts=2, n=4, logprobs=5, logprobs_field="logprobs")  # at the limits: fine
    for args, fragment, param in (
        ((3, 3, None, "logprobs"), "3 prompts x n=3 = 9 exceeds the limit of max_n=8", "n"),
        ((1, 9, None, "logprobs"), "n=9 exceeds the limit of max_n=8", "n"),
        ((1, 1, 6, "top_logprobs"), "top_logprobs=6 exceeds the limit of max_logprobs=5", "top_logprobs"),
    ):
        with pytest.raises(APIError) as info:
            limits.check(*args)
        assert fragment in info.value.message and info.value.param == param and info.value.status == 400


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"top_p": 1.5}, "top_p", "SamplingParams.top_p=1.5 is invalid: allowed is 0 < top_p <= 1"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "SamplingParams.min_tokens=5 is invalid: allowed is min_tokens <= max_tokens (2)"),
        ({"stop": [""]}, "stop", "SamplingParams.stop=[''] is invalid: allowed is non-empty strings"),
    ],
)
def test_a_sampling_value_the_engine_refuses_is_a_400_naming_its_field(fields, param, message):
    """The field comes from the exception SamplingParams raises, not from its message."""
    from pagedserve.cluster.openai_serving import APIError, _sampling_params

    request = CompletionRequest(model="m", prompt="x", **fields)
    with pytest.raises(APIError) as info:
        _sampling_params(request, request.max_tokens, request.logprobs)
    assert info.value.body() == {"error": {"message": message, "type": "BadRequestError", "code": 400, "param": param}}


def test_another_value_error_is_a_400_naming_no_field(monkeypatch):
    from pagedserve.cluster.openai_serving import APIError, _sampling_params

    request = CompletionRequest(model="m", prompt="x")

    def refuse(*args):
        raise ValueError("SamplingParams.n=1 looks like a field but is not one")

    monkeypatch.setattr(CompletionRequest, "sampling_params", refuse)
    with pytest.raises(APIError) as info:
        _sampling_params(request, None, None)
    assert info.value.param is None and info.value.status == 400


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("stop", ["s"] * 17, "at most 16 stop strings are allowed, got 17"),
        ("stop", ["s"] * 200_000, "at most 16 stop strings are allowed, got 200000"),
        ("stop", "x" * 257, "at most 256 characters, got one of 257"),
        ("stop", ["ok", "x" * 257], "at most 256 characters, got one of 257"),
        ("stop_token_ids", list(range(257)), "at most 256 stop token ids are allowed, got 257"),
    ],
)
def test_stop_lists_are_capped(field, value, fragment):
    """The HTTP check, before SamplingParams: a 400 that names the OpenAI field (issue 19)."""
    for model in (CompletionRequest, ChatCompletionRequest):
        body = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
        with pytest.raises(ValidationError) as info:
            model(model="m", **body, **{field: value})
        (error,) = info.value.errors()
        assert error["loc"] == (field,) and fragment in error["msg"]
    at_cap = CompletionRequest(model="m", prompt="x", stop=["x" * 256] * 16, stop_token_ids=list(range(256)))
    assert len(at_cap.sampling_params(4, None).stop) == 16
