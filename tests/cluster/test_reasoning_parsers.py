"""Reasoning parsers: <think>...</think> split into reasoning_content, whole and streamed in
every split (the deltas add up to the whole reply), and alongside a tool-call parser."""

from __future__ import annotations

import pytest

from pagedserve.cluster.chat_output import ChatOutput
from pagedserve.cluster.reasoning_parsers import get_reasoning_parser
from pagedserve.cluster.serving_options import ServingOptions

CASES = [
    # parser, text, reasoning, content
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n", "\n\nIt is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),  # thinking off
    ("qwen3", "<think>cut short", "cut short", ""),
    ("qwen3", "<thin", None, "<thin"),  # looked like a tag, was not
    ("deepseek_r1", "Let me think. 2+2=4.</think>The answer is 4.", "Let me think. 2+2=4.", "The answer is 4."),
    ("deepseek_r1", "<think>x</think>y", "x", "y"),
    ("deepseek_r1", "still thinking </thi", "still thinking </thi", ""),
]


@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_whole_reply(parser, text, reasoning, content):
    message, _ = ChatOutput(ServingOptions(reasoning_parser=parser), "none", False).message(text, "stop")
    assert (message["reasoning_content"], message["content"]) == (reasoning, content)


@pytest.mark.parametrize("step", [1, 3, 100])
@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_streamed_deltas_add_up(parser, text, reasoning, content, step):
    stream = ChatOutput(ServingOptions(reasoning_parser=parser), "none", False).stream()
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    got = {"reasoning_content": "", "content": ""}
    for number, piece in enumerate(pieces):
        delta, _ = stream.delta(piece, "stop" if number == len(pieces) - 1 else None)
        for key, value in delta.items():
            got[key] += value
    assert (got["reasoning_content"] or None, got["content"]) == (reasoning, content)


def test_reasoning_then_a_tool_call():
    options = ServingOptions(reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes")
    text = '<think>I need the weather.</think>\n<tool_call>\n{"name": "w", "arguments": {"c": "Oslo"}}\n</tool_call>'
    message, finish = ChatOutput(options, "auto", True).message(text, "stop")
    assert message["reasoning_content"] == "I need the weather."
    assert message["content"] == "\n" and finish == "tool_calls"
    assert message["tool_calls"][0]["function"] == {"name": "w", "arguments": '{"c": "Oslo"}'}


def test_unknown_parser_is_refused_naming_the_known():
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("r2")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServingOptions(enable_auto_tool_choice=True)
