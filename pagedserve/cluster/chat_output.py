"""A chat completion's text turned into OpenAI's message or stream deltas: `reasoning_content`
split off by the server's reasoning parser, then `tool_calls` found by the tool-call parser the
request's tool_choice calls for (a forced call's plain JSON, or the server's --tool-call-parser
under "auto").

Streams re-read the text so far at every step and send what is new: the parsers' parts only grow
(reasoning_parsers/, tool_parsers/base.py), so the deltas add up to the unstreamed message. A
call is announced (index, id, type, name) once its name is whole; its arguments follow as they
grow, as OpenAI streams them.
"""

from __future__ import annotations

import secrets
import string
import uuid
from typing import Any

from pagedserve.cluster.serving_options import ServingOptions
from pagedserve.cluster.reasoning_parsers import ReasoningParser, get_reasoning_parser
from pagedserve.cluster.structured_requests import FieldError
from pagedserve.cluster.tool_parsers import ParsedCall, ToolParse, ToolParser, get_tool_parser
from pagedserve.cluster.tool_formats import forced_call_parser
from pagedserve.cluster.tool_requests import NamedToolChoice, ToolChoice


MISTRAL_CALL_ID_CHARS = string.ascii_letters + string.digits


def new_call_id(tool_call_parser: str | None = None) -> str:
    """OpenAI's `call_` + 24 hex digits; under mistral, 9 letters and digits, the only ids
    Mistral's chat templates accept (vLLM's MistralToolCall.generate_random_id)."""
    if tool_call_parser == "mistral":
        return "".join(secrets.choice(MISTRAL_CALL_ID_CHARS) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatOutput:
    """One chat request's parsers (shared by its choices)."""

    def __init__(self, options: ServingOptions, tool_choice: ToolChoice, has_tools: bool):
        self.reasoning: ReasoningParser | None = get_reasoning_parser(options.reasoning_parser) if options.reasoning_parser else None
        self.tool_call_parser = options.tool_call_parser  # (the shape of call ids)
        self.is_named = isinstance(tool_choice, NamedToolChoice)
        self.tools: ToolParser | None = None
        if has_tools and (self.is_named or tool_choice == "required"):
            self.tools = forced_call_parser(options.tool_call_parser)  # the format the grammar writes
        elif has_tools and tool_choice == "auto":
            if not options.enable_auto_tool_choice or options.tool_call_parser is None:
                raise FieldError(
                    "tool_choice",
                    '"auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser NAME; '
                    'use "required", a named function or "none"',
                )
            self.tools = get_tool_parser(options.tool_call_parser)

    @property
    def keeps_special_tokens(self) -> bool:
        """The parser's markers are special tokens, which the text must keep."""
        return self.tools is not None and self.tools.needs_special_tokens

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole reply's message, and its finish reason ("tool_calls" when it made calls)."""
        reasoning, content = self._split(text, True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning_content"] = reasoning or None
        if self.tools is not None:
            parsed = self._parse_final(content, finish_reason)
            if parsed.calls:
                message["content"] = parsed.content or None
                message["tool_calls"] = [_call(new_call_id(self.tool_call_parser), call) for call in parsed.calls]
                finish_reason = self._finish_reason(finish_reason)
        return message, finish_reason

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)

    def _split(self, text: str, is_final: bool) -> tuple[str, str]:
        return self.reasoning.split(text, is_final) if self.reasoning is not None else ("", text)

    def _parse_final(self, content: str, finish_reason: str | None) -> ToolParse:
        """The whole reply's parse. A reply cut off by max_tokens in the middle of its calls keeps
        the calls begun (the last with its arguments as far as they got), as OpenAI sends a
        truncated call: finish_reason "length" says so, and a stream that already announced the
        calls is not contradicted by the same text arriving again as content."""
        parsed = self.tools.parse(content, True)
        if parsed.calls or finish_reason != "length":
            return parsed
        partial = self.tools.parse(content, False)
        begun = [call for call in partial.calls if call.name is not None]
        return ToolParse(partial.content, begun) if begun else parsed

    def _finish_reason(self, finish_reason: str | None) -> str | None:
        # OpenAI ends a call the request named with "stop", any other call with "tool_calls".
        return "tool_calls" if finish_reason == "stop" and not self.is_named else finish_reason


class ChoiceStream:
    """One streamed choice: its text so far, and what of it has been sent."""

    def __init__(self, output: ChatOutput):
        self.output = output
        self.text = ""
        self.num_reasoning_sent = 0
        self.num_content_sent = 0
        self.calls_sent: list[int] = []  # per announced call: characters of its arguments sent

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The delta for `new_text`, and the finish reason to send with it."""
        self.text += new_text
        is_final = finish_reason is not None
        reasoning, content = self.output._split(self.text, is_final)
        delta: dict[str, Any] = {}
        if reasoning[self.num_reasoning_sent :]:
            delta["reasoning_content"] = reasoning[self.num_reasoning_sent :]
            self.num_reasoning_sent = len(reasoning)
        calls: list[ParsedCall] = []
        if self.output.tools is not None:
            parsed = self.output._parse_final(content, finish_reason) if is_final else self.output.tools.parse(content, False)
            content, calls = parsed.content, parsed.calls
        if content[self.num_content_sent :]:
            delta["content"] = content[self.num_content_sent :]
            self.num_content_sent = len(content)
        tool_deltas = self._call_deltas(calls)
        if tool_deltas:
            delta["tool_calls"] = tool_deltas
        if is_final and self.calls_sent and calls:
            finish_reason = self.output._finish_reason(finish_reason)
        return delta, finish_reason

    def _call_deltas(self, calls: list[ParsedCall]) -> list[dict[str, Any]]:
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # calls are announced in order, each once its name is whole
            if index == len(self.calls_sent):
                deltas.append({"index": index, **_call(new_call_id(self.output.tool_call_parser), call)})
                self.calls_sent.append(len(call.arguments))
                continue
            fragment = call.arguments[self.calls_sent[index] :]
            if fragment:
                deltas.append({"index": index, "function": {"arguments": fragment}})
                self.calls_sent[index] = len(call.arguments)
        return deltas


def _call(call_id: str, call: ParsedCall) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
