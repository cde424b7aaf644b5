"""Turning a conversation into a prompt through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any

from pagedserve.inputs import TokensPrompt


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None = None, add_generation_prompt: bool = True) -> TokensPrompt:
    """A prompt dict (text and token ids) for the engine; ValueError if the template rejects it."""
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except Exception as error:  # jinja and transformers raise many kinds
        raise ValueError(f"cannot apply the chat template: {error}") from None
    # The template already holds any special tokens: the tokenizer must not add more.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
