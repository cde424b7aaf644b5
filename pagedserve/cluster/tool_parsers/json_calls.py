"""Calls written as plain JSON: the format a forced call's grammar produces (tool_choice required
or named), and the parsers for formats that are JSON with little around it.

- json: `{"name": ..., "arguments": {...}}`, or a list of them.
- llama3_json: Llama 3.1+'s `<|python_tag|>`-optional `{"name": ..., "parameters": {...}}`,
  several separated by ';'.
"""

from __future__ import annotations

from pagedserve.cluster.tool_parsers.base import ParsedCall, ToolParse, ToolParser, call_at, calls_in_array
from pagedserve.cluster.tool_parsers.json_scan import NotJson, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class JsonToolParser(ToolParser):
    """A reply that is a JSON call object or array of them is calls; any other reply is content."""

    name = "json"

    def _parse(self, text: str, is_final: bool) -> ToolParse:
        start = skip_whitespace(text, 0)
        if start == len(text):
            return ToolParse(text if is_final else "")
        if text[start] == "[":
            calls, end = calls_in_array(text, start)
        elif text[start] == "{":
            call, end = call_at(text, start)
            calls = [call]
        else:
            return ToolParse(text)
        if is_final and (end is None or text[end:].strip()):
            raise NotJson("text after the calls")
        return ToolParse("", calls)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = True  # <|python_tag|> is a special token

    def _parse(self, text: str, is_final: bool) -> ToolParse:
        start = skip_whitespace(text, 0)
        rest = text[start:]
        if not is_final and PYTHON_TAG.startswith(rest):
            return ToolParse("")  # may be the tag's start: wait
        if rest.startswith(PYTHON_TAG):
            start = skip_whitespace(text, start + len(PYTHON_TAG))
        if start == len(text):
            return ToolParse(text if is_final else "")
        if text[start] != "{":
            return ToolParse(text)
        calls: list[ParsedCall] = []
        index = start
        while True:
            call, end = call_at(text, index)
            calls.append(call)
            if end is None:
                return ToolParse("", calls)
            index = skip_whitespace(text, end)
            if index < len(text) and text[index] == ";":
                index = skip_whitespace(text, index + 1)
            if index >= len(text):
                return ToolParse("", calls)
            if text[index] != "{":
                raise NotJson("expected another call after ';'")
