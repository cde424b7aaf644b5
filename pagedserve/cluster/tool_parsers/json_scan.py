"""Scanning JSON text that may still be growing (a model's output mid-stream): where a value
ends, if it has ended yet, and the members of an object seen so far. Scanning never raises on
text that is merely incomplete; text that cannot become JSON raises `NotJson`."""

from __future__ import annotations

from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_SCALAR_END = ",}] \t\n\r"


class NotJson(ValueError):
    """The text cannot be (the start of) the JSON value expected there."""


def skip_whitespace(text: str, index: int) -> int:
    while index < len(text) and text[index] in WHITESPACE:
        index += 1
    return index


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value that begins at `start` (no leading whitespace), or
    None if the text ends inside it. Structure is checked (brackets, strings); scalars and the
    whole value are checked by json.loads once complete."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        return _container_end(text, start)
    if first not in "-0123456789tfn":
        raise NotJson(f"unexpected {first!r} where a JSON value starts")
    index = start
    while index < len(text) and text[index] not in _SCALAR_END:
        index += 1
    return index if index < len(text) else None  # a number may still grow


def _string_end(text: str, start: int) -> int | None:
    index = start + 1
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == '"':
            return index + 1
        index += 1
    return None


def _container_end(text: str, start: int) -> int | None:
    closers = []
    index = start
    while index < len(text):
        char = text[index]
        if char == '"':
            end = _string_end(text, index)
            if end is None:
                return None
            index = end
            continue
        if char in "{[":
            closers.append("}" if char == "{" else "]")
        elif char in "}]":
            if not closers or closers.pop() != char:
                raise NotJson(f"unbalanced {char!r}")
            if not closers:
                return index + 1
        index += 1
    return None


@dataclass
class Member:
    """One `"key": value` of an object: where its value starts and ends (None: not yet)."""

    key: str
    value_start: int
    value_end: int | None


@dataclass
class ObjectScan:
    members: dict[str, Member]
    end: int | None  # just past the closing brace; None while the object is incomplete


def scan_object(text: str, start: int) -> ObjectScan:
    """The members of the object beginning at text[start] == "{" seen so far."""
    import json

    if text[start] != "{":
        raise NotJson("expected a JSON object")
    members: dict[str, Member] = {}
    index = skip_whitespace(text, start + 1)
    if index < len(text) and text[index] == "}":
        return ObjectScan(members, index + 1)
    while index < len(text):
        if text[index] != '"':
            raise NotJson("expected a member name")
        key_end = _string_end(text, index)
        if key_end is None:
            break
        key = json.loads(text[index:key_end])
        index = skip_whitespace(text, key_end)
        if index >= len(text):
            break
        if text[index] != ":":
            raise NotJson("expected ':' after a member name")
        value_start = skip_whitespace(text, index + 1)
        if value_start >= len(text):
            break
        end = value_end(text, value_start)
        members[key] = Member(key, value_start, end)
        if end is None:
            break
        index = skip_whitespace(text, end)
        if index >= len(text):
            break
        if text[index] == "}":
            return ObjectScan(members, index + 1)
        if text[index] != ",":
            raise NotJson("expected ',' or '}' after a member")
        index = skip_whitespace(text, index + 1)
    return ObjectScan(members, None)
