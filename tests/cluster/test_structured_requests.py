"""response_format, structured_outputs, tools and logit_bias as request fields: their mapping onto
SamplingParams, and bad values refused with a 400 that names the field (no server needed)."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import ValidationError

from pagedserve.cluster.openai_serving import APIError, _chat_output, _sampling_params
from pagedserve.cluster.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.cluster.serving_options import ServingOptions
from pagedserve.cluster.tool_requests import MAX_TOOLS

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=USER, **fields)


def params(request):
    forced, _ = _chat_output(request, ServingOptions()) if isinstance(request, ChatCompletionRequest) else (None, None)
    return _sampling_params(request, 8, None, None, forced)


def refusal(request) -> APIError:
    with pytest.raises(APIError) as error:
        params(request)
    assert error.value.status == 400
    return error.value


def test_response_format_json_schema():
    so = params(chat(response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA}})).structured_outputs
    assert (so.json, so.disable_any_whitespace, so.disable_additional_properties) == (SCHEMA, True, False)
    strict = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA, "strict": True}}
    assert params(chat(response_format=strict)).structured_outputs.disable_additional_properties  # OpenAI's strict: closed objects
    no_schema = {"type": "json_schema", "json_schema": {"name": "out"}}
    assert params(chat(response_format=no_schema)).structured_outputs.json_object


def test_response_format_json_object_and_text():
    assert params(chat(response_format={"type": "json_object"})).structured_outputs.json_object
    assert params(chat(response_format={"type": "text"})).structured_outputs is None
    assert params(chat()).structured_outputs is None


def test_completions_take_both_fields():
    request = CompletionRequest(model="m", prompt="x", structured_outputs={"regex": "[a-z]+"})
    assert params(request).structured_outputs.regex == "[a-z]+"
    request = CompletionRequest(model="m", prompt="x", response_format={"type": "json_object"})
    assert params(request).structured_outputs.json_object


@pytest.mark.parametrize("field, kind, value", [
    ({"json": SCHEMA}, "json", SCHEMA), ({"json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA)),
    ({"choice": ["yes", "no"]}, "choice", ["yes", "no"]), ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ({"json_object": True}, "json_object", True),
])
def test_vllm_structured_outputs_field(field, kind, value):
    so = params(chat(structured_outputs=field)).structured_outputs
    assert so.kind == kind and getattr(so, kind) == value


def test_free_whitespace_is_opt_in():
    so = params(chat(response_format={"type": "json_object"})).structured_outputs
    assert so.disable_any_whitespace  # compact JSON by default, unlike vLLM
    options_only = {"disable_any_whitespace": False}
    so = params(chat(response_format={"type": "json_object"}, structured_outputs=options_only)).structured_outputs
    assert so.json_object and not so.disable_any_whitespace
    assert not params(chat(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False})).structured_outputs.disable_any_whitespace
    assert params(chat(structured_outputs=options_only)).structured_outputs is None  # options alone: no grammar


@pytest.mark.parametrize("fields, param, fragment", [
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format", "give only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "json"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"5": 101.0}}, "logit_bias", "outside"),
    ({"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias", "limit of 300"),
])
def test_bad_specs_are_a_400_naming_the_field(fields, param, fragment):
    error = refusal(chat(**fields))
    assert error.param == param and fragment in error.message


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema"}},  # json_schema missing
    {"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
    {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_object", "extra": 1}},
    {"structured_outputs": {"jsn": {}}},
    {"structured_outputs": {"disable_any_whitespace": "no"}},
])
def test_malformed_fields_fail_validation(body):
    with pytest.raises(ValidationError):
        chat(**body)


def test_logit_bias_maps_onto_token_ids():
    assert params(chat(logit_bias={"5": -100, "7": 2.5})).logit_bias == {5: -100.0, 7: 2.5}


# ---- tools -------------------------------------------------------------------------------


def tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, "description": f"{name} things"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def test_named_tool_choice_forces_that_functions_call():
    request = chat(tools=[tool("f", SCHEMA), tool("g")], tool_choice={"type": "function", "function": {"name": "f"}})
    schema = params(request).structured_outputs.json
    assert schema["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert schema["properties"]["arguments"] == SCHEMA and schema["required"] == ["name", "arguments"]


def test_required_is_a_list_of_calls_when_parallel():
    request = chat(tools=[tool("f", SCHEMA), tool("g")], tool_choice="required")
    schema = params(request).structured_outputs.json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [option["properties"]["name"]["enum"] for option in schema["items"]["anyOf"]] == [["f"], ["g"]]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    one = params(chat(tools=[tool("f", SCHEMA)], tool_choice="required", parallel_tool_calls=False)).structured_outputs.json
    assert one["type"] == "object" and one["properties"]["name"]["enum"] == ["f"]


def test_auto_and_none_generate_freely():
    assert params(chat(tools=[tool("f")], tool_choice="none")).structured_outputs is None
    options = ServingOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    forced, output = _chat_output(chat(tools=[tool("f")]), options)  # tool_choice defaults to auto
    assert forced is None and output.tools.name == "hermes"


@pytest.mark.parametrize("fields, param, fragment", [
    ({"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not among"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [tool("f")]}, "tool_choice", "enable-auto-tool-choice"),  # auto without the server's parser
    ({"tools": [tool(f"f{i}") for i in range(MAX_TOOLS + 1)], "tool_choice": "none"}, "tools", "limit of 128"),
    ({"tools": [tool("f", {"description": "x" * 300_000})], "tool_choice": "none"}, "tools", "characters"),
    ({"tools": [tool("f"), tool("f")], "tool_choice": "none"}, "tools", "unique"),
    ({"tools": [tool("f")], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "only one"),
])
def test_bad_tools_are_a_400_naming_the_field(fields, param, fragment):
    error = refusal(chat(**fields))
    assert error.param == param and fragment in error.message, error.message


def test_agent_loop_messages():
    request = ChatCompletionRequest(model="m", messages=[
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ])
    assistant, result = (m.as_template_message() for m in request.messages[1:])
    assert assistant["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}  # templates read a mapping
    assert result == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    with pytest.raises(ValidationError, match="only allowed on assistant"):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x", "tool_calls": []}])


# ---- forced calls in the model's format ----------------------------------------------------


def hermes_spec(**fields) -> tuple[str, object]:
    options = ServingOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    spec, output = _chat_output(chat(tools=[tool("f", SCHEMA), tool("g")], **fields), options)
    return spec["grammar"], output


def accepts(grammar: str, text: str) -> bool:
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(xgr.Grammar.from_ebnf(grammar), text)


def test_hermes_server_forces_calls_in_tool_call_tags():
    grammar, output = hermes_spec(tool_choice="required")
    call_f, call_g = '<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>', '<tool_call>\n{"name":"g","arguments":{}}\n</tool_call>'
    assert accepts(grammar, call_f) and accepts(grammar, f"{call_f}\n{call_g}")  # parallel: one or more blocks
    assert not accepts(grammar, '{"name":"f","arguments":{"a":1}}')  # not bare JSON
    assert not accepts(grammar, '<tool_call>\n{"name":"f","arguments":{"a":"x"}}\n</tool_call>')  # the schema holds
    # Compact, as vLLM's disable_any_whitespace: not even a space after ":" or ",".
    assert not accepts(grammar, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert output.tools.name == "hermes"
    message, finish = output.message(f"{call_f}\n{call_g}", "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["f", "g"] and finish == "tool_calls"


def test_hermes_named_call_is_one_block_and_free_whitespace_is_opt_in():
    grammar, _ = hermes_spec(tool_choice={"type": "function", "function": {"name": "f"}})
    call = '<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>'
    assert accepts(grammar, call) and not accepts(grammar, f"{call}\n{call}")
    grammar, _ = hermes_spec(tool_choice="required", structured_outputs={"disable_any_whitespace": False})
    assert accepts(grammar, '<tool_call>\n{ "name" : "f",\n "arguments": {"a": 1} }\n</tool_call>')


def test_hermes_frame_refuses_a_bad_parameters_schema_naming_tools():
    options = ServingOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    request = chat(tools=[tool("f", {"type": "object", "properties": {"a": {"type": 5}}})], tool_choice="required")
    with pytest.raises(APIError) as error:
        _chat_output(request, options)
    assert error.value.status == 400 and error.value.param == "tools"


def forced_spec(parser: str, **fields) -> tuple[dict, object]:
    options = ServingOptions(enable_auto_tool_choice=True, tool_call_parser=parser)
    return _chat_output(chat(tools=[tool("f", SCHEMA), tool("g")], **fields), options)


def test_llama3_json_server_forces_calls_in_llama3s_own_shape():
    """{"name": ..., "parameters": {...}}, several joined by "; ", read back by the llama3_json parser."""
    spec, output = forced_spec("llama3_json", tool_choice="required")
    call_f, call_g = '{"name":"f","parameters":{"a":1}}', '{"name":"g","parameters":{}}'
    grammar = spec["grammar"]
    assert accepts(grammar, call_f) and accepts(grammar, f"{call_f}; {call_g}")
    assert not accepts(grammar, '{"name":"f","arguments":{"a":1}}')  # OpenAI's key is not Llama's
    assert not accepts(grammar, '{"name":"f","parameters":{"a":"x"}}')  # the schema holds
    assert output.tools.name == "llama3_json"
    message, finish = output.message(f"{call_f}; {call_g}", "stop")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [("f", {"a": 1}), ("g", {})]
    assert finish == "tool_calls"
    named, _ = forced_spec("llama3_json", tool_choice={"type": "function", "function": {"name": "f"}})
    assert set(named["json"]["properties"]) == {"name", "parameters"}  # one call: a JSON schema either backend takes


def test_mistral_server_forces_the_call_array_and_ids_of_nine_characters():
    """Mistral's [TOOL_CALLS] is a special token no grammar writes: the forced reply is the JSON
    array that follows it; its call ids are the 9 letters and digits Mistral's templates want."""
    spec, output = forced_spec("mistral", tool_choice={"type": "function", "function": {"name": "f"}})
    assert spec["json"]["type"] == "array" and spec["json"]["maxItems"] == 1
    message, finish = output.message('[{"name": "f", "arguments": {"a": 1}}]', "stop")
    [call] = message["tool_calls"]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]) and call["function"]["name"] == "f" and finish == "stop"  # (named: as OpenAI)
    assert "maxItems" not in forced_spec("mistral", tool_choice="required")[0]["json"]
    hermes_call = hermes_spec(tool_choice="required")[1].message('<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>', "stop")[0]
    assert re.fullmatch(r"call_[0-9a-f]{24}", hermes_call["tool_calls"][0]["id"])


def test_the_guidance_backend_refuses_the_hermes_frame_clearly():
    """A framed call is xgrammar's EBNF, which llguidance cannot read: under
    structured_outputs_backend guidance the input check refuses it (a 400 where the request
    enters), never a failure later."""
    from pagedserve.engine.structured_outputs.validation import resolve_backend_name
    from pagedserve.sampling_params import StructuredOutputsParams

    grammar, _ = hermes_spec(tool_choice="required")
    params = StructuredOutputsParams(grammar=grammar)
    assert resolve_backend_name(params, "auto") == "xgrammar"
    with pytest.raises(ValueError, match="StructuredOutputsParams.grammar is invalid for llguidance"):
        resolve_backend_name(params, "guidance")
