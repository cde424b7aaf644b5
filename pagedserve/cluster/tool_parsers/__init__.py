"""Tool-call parsers for tool_choice "auto", picked with vLLM's flags
`--enable-auto-tool-choice --tool-call-parser NAME`."""

from __future__ import annotations

from pagedserve.cluster.tool_parsers.base import ParsedCall, ToolParse, ToolParser
from pagedserve.cluster.tool_parsers.hermes import HermesToolParser
from pagedserve.cluster.tool_parsers.json_calls import JsonToolParser, Llama3JsonToolParser
from pagedserve.cluster.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, JsonToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool_call_parser {name!r}; known: {', '.join(TOOL_PARSERS)}") from None


__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolParse", "ToolParser", "get_tool_parser"]
