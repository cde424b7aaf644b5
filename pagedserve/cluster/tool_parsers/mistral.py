"""Mistral's calls after the `[TOOL_CALLS]` token, in either of its formats: a JSON array of
{"name", "arguments"} objects (tokenizers before v11), or `name[ARGS]{...}` per call, each
after its own `[TOOL_CALLS]` (v11 and later; an optional `[CALL_ID]id` before `[ARGS]`)."""

from __future__ import annotations

import json

from pagedserve.cluster.tool_parsers.base import ParsedCall, ToolParse, ToolParser, calls_in_array, held_back
from pagedserve.cluster.tool_parsers.json_scan import NotJson, skip_whitespace, value_end

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] is a special token

    def _parse(self, text: str, is_final: bool) -> ToolParse:
        first = text.find(MARKER)
        if first < 0:
            return ToolParse(text if is_final else held_back(text, MARKER))
        start = skip_whitespace(text, first + len(MARKER))
        if start < len(text) and text[start] == "[":
            calls, _ = calls_in_array(text, start)
            return ToolParse(text[:first], calls)
        calls = []
        index = first
        while index >= 0:
            call, end = _named_call(text, index + len(MARKER))
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            index = text.find(MARKER, end)
        return ToolParse(text[:first], calls)


def _named_call(text: str, start: int) -> tuple[ParsedCall | None, int | None]:
    """`name[ARGS]{...}` at `start`; (None, None) while the name is still being written."""
    args_at = text.find(ARGS, start)
    if args_at < 0:
        return None, None
    name = text[start:args_at].split(CALL_ID)[0].strip()
    if not name or any(c in name for c in '{}[]"'):
        raise NotJson("a call's name comes before [ARGS]")
    value_start = skip_whitespace(text, args_at + len(ARGS))
    if value_start >= len(text):
        return ParsedCall(name, ""), None
    if text[value_start] != "{":
        raise NotJson("arguments are a JSON object")
    end = value_end(text, value_start)
    arguments = text[value_start : end if end is not None else len(text)]
    is_complete = end is not None and isinstance(_loads(arguments), dict)
    return ParsedCall(name, arguments, is_complete), end


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
