"""Tool calling's request side: OpenAI's `tools`, `tool_choice` and the messages of an agent loop
(assistant `tool_calls`, `role: tool` results), their bounds, and the grammar a forced call uses.

`tool_choice`: "none" (free text, tools still in the prompt), "auto" (free text, then the
server's --tool-call-parser looks for calls), "required" or a named function (a grammar makes
the output a valid call: one, or one or more when `parallel_tool_calls` is true and the choice
is "required"; tool_formats.py writes them in the model's format).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.cluster.structured_requests import NAME_PATTERN, FieldError

MAX_TOOLS = 128  # OpenAI's own limit on `tools`
MAX_TOOLS_CHARS = 256 * 1024  # the serialized `tools`: schemas are compiled and sit in every prompt


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: a function without parameters
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    """A call in an assistant message the client sends back (the previous turn's answer)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: FunctionCall

    def as_template_call(self) -> dict[str, Any]:
        """Templates read the arguments as a mapping (`arguments | tojson`), as vLLM passes them;
        arguments that are not a JSON object stay text."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


def check_tools(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> None:
    """The bounds on `tools`, and a `tool_choice` that names a tool the request has."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise FieldError("tool_choice", "tool_choice other than 'none' needs tools")
        return
    if len(tools) > MAX_TOOLS:
        raise FieldError("tools", f"{len(tools)} tools exceed the limit of {MAX_TOOLS}")
    size = len(json.dumps([tool.model_dump(exclude_none=True) for tool in tools]))
    if size > MAX_TOOLS_CHARS:
        raise FieldError("tools", f"the tools take {size} characters as JSON, over the limit of {MAX_TOOLS_CHARS}")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise FieldError("tools", "function names must be unique")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise FieldError("tool_choice", f"function {tool_choice.function.name!r} is not among the tools ({', '.join(names)})")


def resolved_tool_choice(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: "auto" with tools, "none" without."""
    if tool_choice is not None:
        return tool_choice
    return "auto" if tools else "none"


@dataclass(frozen=True)
class ForcedCall:
    """What a forced tool_choice makes the reply: one call, or one or more (tool_formats.py
    writes them in the model's format)."""

    call_schema: dict[str, Any]  # the JSON schema of one call
    is_list: bool  # "required" with parallel_tool_calls: one or more calls

    def json_schema(self) -> dict[str, Any]:
        """The plain JSON form: the call object, or a list of them."""
        return {"type": "array", "items": self.call_schema, "minItems": 1} if self.is_list else self.call_schema


def forced_call(tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool) -> ForcedCall | None:
    """The call(s) the request forces; None when it forces none."""
    if isinstance(tool_choice, NamedToolChoice):
        chosen = next(tool for tool in tools if tool.function.name == tool_choice.function.name)
        return ForcedCall(_call_schema(chosen.function), False)
    if tool_choice != "required":
        return None
    calls = [_call_schema(tool.function) for tool in tools]
    return ForcedCall(calls[0] if len(calls) == 1 else {"anyOf": calls}, parallel_tool_calls)


def _call_schema(function: FunctionDefinition) -> dict[str, Any]:
    """{"name": <this function>, "arguments": <its parameters>}, name first (the streamed call
    is announced as soon as its name is complete)."""
    parameters = function.parameters if function.parameters else {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [function.name]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """`tools` as chat templates read them (apply_chat_template(tools=...))."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]
