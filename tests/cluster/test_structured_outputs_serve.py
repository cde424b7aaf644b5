"""Structured outputs, tool calls and request defaults over HTTP, on real Ray Serve with the real
`openai` client: the replies parse and validate, streamed calls add up to the unstreamed ones,
and the constrained greedy reply equals the offline engine's with the same grammar.

Its own app: it runs with `--generation-config FOLDER` (greedy by default, so a request that
omits temperature is checked against the offline greedy run) and `--tool-call-parser hermes`.
A random-weight model writes no tool calls of its own, so "auto" parsing is tested on crafted
text (test_tool_parsers.py); here calls are forced (tool_choice required or named)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.cluster.server_config import ServerConfig
from tests.cluster.conftest import deploy

MODEL = "so-llama"
APP = "structured-outputs"
PREFIX = "/so"
MAX_MODEL_LEN = 512
# Bounded values: a random-weight model given an unbounded string or number writes until max_tokens.
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
}
# Short: the test model's 512 positions hold the prompt, which describes the tools.
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}}}},
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def base_url(serve_url, model_dirs, tmp_path_factory):
    from ray import serve

    defaults = tmp_path_factory.mktemp("generation-config")
    (defaults / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    config = ServerConfig(
        model=str(model_dirs["llama"]), served_model_name=MODEL, engine={"max_model_len": MAX_MODEL_LEN},
        enable_auto_tool_choice=True, tool_call_parser="hermes", generation_config=str(defaults),
    )
    deploy(config, APP, PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(model_dirs):
    llm = LLM(str(model_dirs["llama"]), max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


def stream_message(chunks) -> tuple[str, list[dict], str | None]:
    """A streamed chat reply put together as OpenAI streams it: content, calls by index, finish."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(calls) and call.type == "function" and call.function.name
                calls.append({"id": call.id, "name": call.function.name, "arguments": call.function.arguments or ""})
            else:
                assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


# ---- response_format and structured_outputs ------------------------------------------------------


def test_json_schema_reply_validates_and_equals_offline(client, offline):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, response_format=response_format)
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), WEATHER)
    assert reply.choices[0].finish_reason == "stop"
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(
        json=WEATHER, disable_additional_properties=True)), use_tqdm=False)[0].outputs[0].text
    assert text == expected  # the request omitted temperature: the served folder's default (greedy)
    chunks = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, response_format=response_format, stream=True)
    assert stream_message(chunks)[0] == text


def test_compact_json_unless_free_whitespace_is_asked_for(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER}}
    compact = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, response_format=response_format)
    assert "\n" not in compact.choices[0].message.content
    free = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, response_format=response_format,
        extra_body={"structured_outputs": {"disable_any_whitespace": False}},
    ).choices[0]
    # The random model loops on free whitespace until max_tokens (why compact is the default);
    # that it writes any shows the option reached the grammar.
    assert free.message.content.startswith("{") and any(c in free.message.content for c in " \n\r\t")
    assert free.message.content != compact.choices[0].message.content


def test_completions_take_vllms_structured_outputs(client):
    choice = client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=10, extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}}
    ).choices[0]
    assert choice.text in ("yes", "no", "maybe") and choice.finish_reason == "stop"
    regex = client.completions.create(model=MODEL, prompt="Code:", max_tokens=10, extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert len(regex.choices[0].text) == 6 and regex.choices[0].text[3] == "-"


def test_json_object_reply_is_an_object(client):
    reply = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=100, extra_body={"response_format": {"type": "json_object"}})
    choice = reply.choices[0]
    # This model opens an object and then writes one endless string value (finish "length").
    assert choice.text.startswith('{"') and (choice.finish_reason == "length" or isinstance(json.loads(choice.text), dict))


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format"),
    ({"logit_bias": {"99999999": 1}}, None),  # past the vocabulary: the engine's check
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_specs_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert error.value.status_code == 400
    if param is not None:
        assert error.value.body["param"] == param


# ---- tools -----------------------------------------------------------------------------------


def test_required_tool_call_streamed_and_not(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=120, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    reply = client.chat.completions.create(**kwargs).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    (call,) = reply.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name in PARAMETERS
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    content, calls, finish = stream_message(client.chat.completions.create(**kwargs, stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_parallel_required_calls_are_a_list(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, tools=TOOLS, tool_choice="required").choices[0]
    calls = reply.message.tool_calls
    # A random-weight model may repeat calls until max_tokens: the calls begun are still calls,
    # only the last one's arguments may be cut off.
    assert calls and reply.finish_reason in ("tool_calls", "length") and reply.message.content is None
    for call in calls if reply.finish_reason == "tool_calls" else calls[:-1]:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_named_tool_call_and_the_next_turn(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    # The whole framed call is about 60 of the test tokenizer's tokens; its grammar ends it well before 120.
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=120, tools=TOOLS, tool_choice=named).choices[0]
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_time" and reply.finish_reason == "stop"  # OpenAI's finish for a named call
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_time"])
    # The agent loop's next turn: the call and its result go back; the template renders them.
    turn = [*MESSAGES, reply.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    answer = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, tools=TOOLS, tool_choice="none").choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason in ("stop", "length")
    # tool_choice auto: free text, parsed by the server's hermes parser (this model writes none).
    auto = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=8, tools=TOOLS).choices[0]
    assert auto.message.content is not None


def test_logit_bias_over_http(client, offline):
    token_id = offline.get_tokenizer().encode("sea")[0]
    choice = client.completions.create(model=MODEL, prompt="The", max_tokens=3, temperature=0, logit_bias={str(token_id): 100}).choices[0]
    assert choice.text.startswith(offline.get_tokenizer().decode([token_id]))
