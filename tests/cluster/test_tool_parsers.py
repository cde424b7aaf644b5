"""Tool-call parsers on crafted model text (a random-weight model writes no calls): the whole
reply, and the same text streamed in every split, whose deltas must add up to the whole reply's
message. Text that fails to parse stays content."""

from __future__ import annotations

import json
import re

import pytest

from pagedserve.cluster.chat_output import ChatOutput
from pagedserve.cluster.serving_options import ServingOptions
from pagedserve.cluster.structured_requests import FieldError
from pagedserve.cluster.tool_parsers import TOOL_PARSERS, get_tool_parser
from pagedserve.cluster.tool_requests import NamedToolChoice

WEATHER = {"city": "Paris", "days": [1, 2], "note": "a \"quoted\" } brace"}
CASES = [
    # parser, text, content, [(name, arguments)]
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}\n</tool_call>",
     "Let me check.", [("get_weather", json.dumps(WEATHER))]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
     "", [("a", "{}"), ("b", '{"x": 1}')]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}', "", [("a", '{"x": 1}')]),  # unclosed at the end
    ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"q": "x"}}; {"name": "g", "parameters": {}}',
     "", [("f", '{"q": "x"}'), ("g", "{}")]),
    ("llama3_json", '{"name": "f", "parameters": {"q": 1}}', "", [("f", '{"q": 1}')]),
    ("mistral", 'Sure[TOOL_CALLS][{"name": "f", "arguments": {"a": [1, {"b": 2}]}}, {"name": "g", "arguments": {}}]',
     "Sure", [("f", '{"a": [1, {"b": 2}]}'), ("g", "{}")]),
    ("mistral", "[TOOL_CALLS]f[ARGS]{\"a\": 1}[TOOL_CALLS]g[CALL_ID]abc123xyz[ARGS]{}", "", [("f", '{"a": 1}'), ("g", "{}")]),
    ("json", '{"name": "f", "arguments": {"a": "}"}}', "", [("f", '{"a": "}"}')]),
    ("json", '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"z": null}}]', "", [("f", "{}"), ("g", '{"z": null}')]),
    ("json", '{"name": "f", "arguments": "{\\"a\\": 1}"}', "", [("f", '{"a": 1}')]),  # arguments as a JSON string
]
NOT_CALLS = [
    ("hermes", "Just an answer, no calls."),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": }</tool_call>'),  # broken JSON
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1'),  # cut short
    ("llama3_json", "The answer is {not json"),
    ("llama3_json", '{"name": "f", "parameters": [1]}'),  # arguments must be an object
    ("mistral", "[TOOL_CALLS]not a call"),
    ("json", '{"name": 5, "arguments": {}}'),
    ("json", '{"name": "f", "arguments": {}} trailing words'),
    ("json", "plain text"),
    ("json", ""),
]


def options(parser: str) -> ServingOptions:
    return ServingOptions(enable_auto_tool_choice=True, tool_call_parser=parser)


def call_id_shape(parser: str) -> str:
    return r"[A-Za-z0-9]{9}" if parser == "mistral" else r"call_[0-9a-f]{24}"  # (Mistral's templates want 9)


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_reply(parser, text, content, calls):
    message, finish = ChatOutput(options(parser), "auto", True).message(text, "stop")
    assert message["content"] == (content or None)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == calls
    assert all(re.fullmatch(call_id_shape(parser), c["id"]) and c["type"] == "function" for c in message["tool_calls"])
    assert len({c["id"] for c in message["tool_calls"]}) == len(calls)
    assert finish == "tool_calls"


@pytest.mark.parametrize("parser, text", NOT_CALLS)
def test_text_that_fails_to_parse_stays_content(parser, text):
    message, finish = ChatOutput(options(parser), "auto", True).message(text, "stop")
    assert message == {"role": "assistant", "content": text} and finish == "stop"


def streamed(parser: str, text: str, step: int) -> tuple[str, list[dict], str | None]:
    """The text fed `step` characters at a time: the content and calls the deltas add up to."""
    stream = ChatOutput(options(parser), "auto", True).stream()
    content, calls, finish = "", [], None
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for number, piece in enumerate(pieces):
        delta, finish = stream.delta(piece, "stop" if number == len(pieces) - 1 else None)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):  # announced: id, type and name come first, once
                assert re.fullmatch(call_id_shape(parser), call["id"]) and call["type"] == "function" and call["function"]["name"]
                calls.append({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, calls, finish


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_streamed_deltas_add_up_to_the_whole_reply(parser, text, content, calls, step):
    got_content, got_calls, finish = streamed(parser, text, step)
    assert got_content == content
    assert [(c["name"], c["arguments"]) for c in got_calls] == calls
    assert finish == "tool_calls"


@pytest.mark.parametrize("parser, text", NOT_CALLS)
def test_streamed_text_that_is_no_call_stays_content(parser, text):
    content, calls, finish = streamed(parser, text, 3)
    if not calls:  # a broken call's name may have been announced before it broke; its text still arrives
        assert content == text
    assert finish == "stop"


def test_arguments_stream_as_they_grow():
    stream = ChatOutput(options("hermes"), "auto", True).stream()
    assert stream.delta("<tool_", None)[0] == {}
    delta, _ = stream.delta('call>{"name": "f", "argu', None)
    assert delta["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert stream.delta('ments": {"a": ', None)[0]["tool_calls"] == [{"index": 0, "function": {"arguments": '{"a": '}}]
    assert stream.delta("12}}</tool_call>", "stop") == ({"tool_calls": [{"index": 0, "function": {"arguments": "12}"}}]}, "tool_calls")


def test_held_back_marker_prefix_is_released_as_content():
    stream = ChatOutput(options("hermes"), "auto", True).stream()
    assert stream.delta("a <tool", None)[0] == {"content": "a "}
    assert stream.delta(" box", "stop") == ({"content": "<tool box"}, "stop")


def test_named_and_required_calls_parse_the_forced_json():
    named = NamedToolChoice(type="function", function={"name": "f"})
    message, finish = ChatOutput(ServingOptions(), named, True).message('{"name": "f", "arguments": {"a": 1}}', "stop")
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'} and finish == "stop"
    message, finish = ChatOutput(ServingOptions(), "required", True).message('[{"name": "f", "arguments": {}}]', "stop")
    assert message["content"] is None and len(message["tool_calls"]) == 1 and finish == "tool_calls"
    _, finish = ChatOutput(ServingOptions(), "required", True).message('[{"name": "f", "arguments": {}}]', "length")
    assert finish == "length"


def test_auto_needs_the_servers_flags():
    with pytest.raises(FieldError, match="enable-auto-tool-choice") as error:
        ChatOutput(ServingOptions(), "auto", True)
    assert error.value.param == "tool_choice"
    assert ChatOutput(ServingOptions(), "auto", False).tools is None  # no tools: nothing to parse
    assert ChatOutput(options("hermes"), "none", True).tools is None


def test_registry_and_special_tokens():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "json"}
    with pytest.raises(ValueError, match="known: hermes"):
        get_tool_parser("nope")
    assert ChatOutput(options("mistral"), "auto", True).keeps_special_tokens
    assert not ChatOutput(options("hermes"), "auto", True).keeps_special_tokens


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_calls_cut_off_by_max_tokens_stay_calls_with_finish_reason_length(step):
    """Truncated mid-call: the calls begun are the reply (the last one's arguments as far as they
    got), whole or streamed, and the stream never repeats their text as content."""
    text = '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "xy'
    message, finish = ChatOutput(ServingOptions(), "required", True).message(text, "length")
    assert finish == "length" and message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("f", '{"a": 1}'), ("g", '{"b": "xy')]
    stream = ChatOutput(ServingOptions(), "required", True).stream()
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    content, calls = "", []
    for number, piece in enumerate(pieces):
        delta, finish = stream.delta(piece, "length" if number == len(pieces) - 1 else None)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                calls.append([call["function"]["name"], call["function"]["arguments"]])
            else:
                calls[call["index"]][1] += call["function"]["arguments"]
    assert content == "" and finish == "length"
    assert calls == [["f", '{"a": 1}'], ["g", '{"b": "xy']]
    # Cut off before any call's name is whole: the text is content, as any unparsable reply.
    message, _ = ChatOutput(ServingOptions(), "required", True).message('[{"na', "length")
    assert message["content"] == '[{"na' and "tool_calls" not in message
