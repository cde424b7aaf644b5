"""Turning a conversation into a prompt through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from pagedserve.engine.chat_tools import has_tool_format, without_tool_format
from pagedserve.inputs import TokensPrompt


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> TokensPrompt:
    """A prompt dict (text and token ids) for the engine; ValueError if the template rejects it.
    `tools`: OpenAI's tool definitions (a template without a tool format: chat_tools.py)."""
    extra: dict[str, Any] = {}
    if has_tool_format(tokenizer, chat_template):
        extra["tools"] = tools
    elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
        messages = without_tool_format(messages, tools)
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except Exception as error:  # jinja and transformers raise many kinds
        raise ValueError(f"cannot apply the chat template: {error}") from None
    # The template already holds any special tokens: the tokenizer must not add more.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
