"""Tools in a chat template that has no tool format (the tiny model's, SmolLM2's): what the
conversation becomes so that the template can render it and the model can see the tools.

A template that mentions `tools` or `tool_calls` renders them itself (apply_chat_template(
tools=...)); for one that does not, the tools are described in the system message, an
assistant's calls are written as the plain JSON a forced call produces, and a tool's result
becomes a user message (such templates often allow no other roles).
"""

from __future__ import annotations

import json
from typing import Any

TOOLS_PREAMBLE = (
    "You can call these functions. To call one, answer with only a JSON object "
    '{"name": <function name>, "arguments": <its arguments>}.\n'
)


def has_tool_format(tokenizer: Any, chat_template: str | None) -> bool:
    """Whether the template that will render the chat reads tools or tool calls itself."""
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    sources = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in source or "tool_calls" in source for source in sources)


def without_tool_format(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation in plain system/user/assistant messages."""
    converted = [_plain(message) for message in messages]
    if not tools:
        return converted
    described = TOOLS_PREAMBLE + json.dumps([tool.get("function", tool) for tool in tools], ensure_ascii=False)
    if converted and converted[0]["role"] == "system":
        first = converted[0]
        return [{**first, "content": f"{first['content']}\n\n{described}"}, *converted[1:]]
    return [{"role": "system", "content": described}, *converted]


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": message.get("content") or ""}
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = [{"name": call["function"]["name"], "arguments": call["function"]["arguments"]} for call in calls]
    text = json.dumps(written[0] if len(written) == 1 else written, ensure_ascii=False)
    content = message.get("content") or ""
    return {"role": "assistant", "content": f"{content}\n{text}" if content else text}
