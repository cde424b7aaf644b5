"""Tools and agent-loop messages through the chat template: a template with a tool format renders
them itself; one without (the tiny model's, which allows only system/user/assistant) gets them as
plain messages (engine/chat_tools.py)."""

from __future__ import annotations

import json

import pytest

from pagedserve.engine.chat import render_chat
from pagedserve.engine.chat_tools import TOOLS_PREAMBLE

# A cut-down Qwen2.5-style (hermes) template: tools in the system turn, calls in <tool_call> tags.
HERMES_TEMPLATE = (
    "{% if tools %}<|system|># Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|user|><tool_response>\n{{ m.content }}\n</tool_response><|end|>"
    "{% elif m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|end|>'
    "{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}}]
LOOP = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
]


def test_a_tool_format_template_renders_tools_and_calls(tokenizer):
    text = render_chat(tokenizer, LOOP, HERMES_TEMPLATE, True, TOOLS)["prompt"]
    assert json.dumps(TOOLS[0]["function"]["name"]) in text and '"description": "Weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n12 C\n</tool_response>" in text and text.endswith("<|assistant|>")


def test_a_template_without_tool_format_gets_plain_messages(tokenizer):
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="roles must be"):  # the template itself refuses the tool role
        tokenizer.apply_chat_template(LOOP, tokenize=False)
    prompt = render_chat(tokenizer, LOOP, None, True, TOOLS)
    text = prompt["prompt"]
    assert text.startswith("<|system|>" + TOOLS_PREAMBLE) and '"name": "get_weather"' in text
    assert '<|assistant|>{"name": "get_weather", "arguments": {"city": "Oslo"}}<|end|>' in text
    assert "<|user|>12 C<|end|>" in text
    assert prompt["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)


def test_tools_join_an_existing_system_message(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = render_chat(tokenizer, messages, None, True, TOOLS)["prompt"]
    assert text.startswith("<|system|>Be brief.\n\n" + TOOLS_PREAMBLE) and text.count("<|system|>") == 1


def test_no_tools_leaves_the_chat_as_it_was(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, messages)["prompt"] == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
