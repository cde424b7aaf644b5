"""Hermes-style calls, as Qwen2.5 and Qwen3 (and Hermes 2 Pro) write them: any content first,
then one or more `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

from pagedserve.cluster.tool_parsers.base import ParsedCall, ToolParse, ToolParser, call_at, held_back
from pagedserve.cluster.tool_parsers.json_scan import NotJson, skip_whitespace

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def _parse(self, text: str, is_final: bool) -> ToolParse:
        first = text.find(START)
        if first < 0:
            return ToolParse(text if is_final else held_back(text, START))
        calls: list[ParsedCall] = []
        index = first
        while index >= 0:
            start = skip_whitespace(text, index + len(START))
            if start == len(text):
                break
            if text[start] != "{":
                raise NotJson("a <tool_call> holds a JSON object")
            call, end = call_at(text, start)
            calls.append(call)
            if end is None:
                break
            after = skip_whitespace(text, end)
            rest = text[after:]
            # An unclosed last call is accepted (the model stopped right after it), as vLLM does.
            if rest and not rest.startswith(END) and not (END.startswith(rest) and not is_final):
                raise NotJson("a call ends with </tool_call>")
            # Text after the calls (the model going on) is dropped, as vLLM does.
            index = text.find(START, after)
        return ToolParse(text[:first], calls)
