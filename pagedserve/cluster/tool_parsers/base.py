"""What every tool-call parser returns, and the pieces they share.

A parser reads a chat completion's text, whole or as it grows (mid-stream), and says which
leading part is content and which calls it holds so far. Both only grow as the text grows, so a
stream can send the difference each step (chat_output.py). On the final text a parser either
finds every call it began whole, or gives the whole text back as content: text that fails to
parse is never an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import ClassVar

from pagedserve.cluster.tool_parsers.json_scan import NotJson, scan_object, skip_whitespace

ARGUMENT_KEYS = ("arguments", "parameters")  # llama 3 writes "parameters"


@dataclass
class ParsedCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # the arguments' JSON text so far; complete once is_complete
    is_complete: bool = False


@dataclass
class ToolParse:
    content: str  # the text known to be content: a prefix of the output that only grows
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser:
    """One model family's tool-call format. Subclasses implement `_parse`, which may raise
    NotJson when the text cannot be calls in this format."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False  # its markers are special tokens: keep them in the text

    def parse(self, text: str, is_final: bool) -> ToolParse:
        try:
            parsed = self._parse(text, is_final)
        except NotJson:
            return ToolParse(text if is_final else "")
        if is_final and (not parsed.calls or not all(call.is_complete for call in parsed.calls)):
            return ToolParse(text)
        return parsed

    def _parse(self, text: str, is_final: bool) -> ToolParse:
        raise NotImplementedError


def held_back(text: str, marker: str) -> str:
    """`text` without a tail that may be the start of `marker` (the rest of it not yet generated)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return text[:-size]
    return text


def call_at(text: str, start: int) -> tuple[ParsedCall, int | None]:
    """The call object {"name": ..., "arguments": {...}} at text[start]; and the index past it
    (None while incomplete)."""
    scan = scan_object(text, start)
    name_member = scan.members.get("name")
    name = None
    if name_member is not None and name_member.value_end is not None:
        name = json.loads(text[name_member.value_start : name_member.value_end])
        if not isinstance(name, str):
            raise NotJson("a call's name must be a string")
    key = next((key for key in ARGUMENT_KEYS if key in scan.members), None)
    arguments = ""
    if key is not None:
        member = scan.members[key]
        end = member.value_end if member.value_end is not None else len(text)
        arguments = text[member.value_start : end]
        if arguments.startswith('"'):  # arguments sent as a JSON string: its text, once whole
            arguments = json.loads(arguments) if member.value_end is not None else ""
    elif scan.end is not None:
        arguments = "{}"  # a call without arguments
    return ParsedCall(name, arguments, scan.end is not None and name is not None and _is_object(arguments)), scan.end


def calls_in_array(text: str, start: int) -> tuple[list[ParsedCall], int | None]:
    """The calls of a JSON array of call objects at text[start] == "["."""
    calls: list[ParsedCall] = []
    index = skip_whitespace(text, start + 1)
    while index < len(text):
        if text[index] == "]" and not calls:
            return calls, index + 1
        if text[index] != "{":
            raise NotJson("expected a call object")
        call, end = call_at(text, index)
        calls.append(call)
        if end is None:
            return calls, None
        index = skip_whitespace(text, end)
        if index >= len(text):
            break
        if text[index] == "]":
            return calls, index + 1
        if text[index] != ",":
            raise NotJson("expected ',' or ']' between calls")
        index = skip_whitespace(text, index + 1)
    return calls, None


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False
