"""Reasoning parsers: `--reasoning-parser qwen3 | deepseek_r1` splits a model's
`<think>...</think>` off its answer into `reasoning_content`, as vLLM does.

`split(text, is_final)` works on the text so far and on the whole text alike: its two parts only
grow as the text grows (a tail that may be the start of a tag is held back until it is known), so
a stream sends their differences and ends with exactly what the unstreamed reply holds.
"""

from __future__ import annotations

from typing import ClassVar

from pagedserve.cluster.tool_parsers.base import held_back

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str]

    def split(self, text: str, is_final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""
        raise NotImplementedError


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1's template opens `<think>` in the prompt: the output is reasoning until
    `</think>` (an opening tag the model writes anyway is dropped); no `</think>`: all reasoning."""

    name = "deepseek_r1"

    def split(self, text: str, is_final: bool) -> tuple[str, str]:
        body = text
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            body = stripped[len(THINK_START) :]
        elif not is_final and THINK_START.startswith(stripped):
            return "", ""  # may be the opening tag: wait
        end = body.find(THINK_END)
        if end < 0:
            return (body if is_final else held_back(body, THINK_END)), ""
        return body[:end], body[end + len(THINK_END) :]


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 writes `<think>` itself when it thinks; output that does not begin with it is all
    content (thinking disabled). A `</think>` that never comes leaves all of it reasoning
    (the reply was cut short mid-thought)."""

    name = "qwen3"

    def split(self, text: str, is_final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_START):
            if not is_final and THINK_START.startswith(stripped):
                return "", ""  # may be the opening tag: wait
            return "", text
        return DeepSeekR1ReasoningParser().split(stripped, is_final)


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning_parser {name!r}; known: {', '.join(REASONING_PARSERS)}") from None
