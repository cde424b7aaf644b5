"""Prompts, as the engine and the server take them: typed dicts with vLLM's names (vllm/inputs).

A prompt is plain text, or one of these dicts. They stay dicts, not classes, because they are what
callers write (`llm.generate({"prompt_token_ids": [...]})`) and what Serve pickles from the ingress
to an engine replica, where the prefix-aware router reads the token ids. A module of the bottom
layer: the engine and the cluster both use it; it imports nothing of the project.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, TypeGuard, Union


class TextPrompt(TypedDict):
    """Text the engine tokenizes."""

    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache hits only among prompts of the same salt (vLLM's name)


class TokensPrompt(TypedDict):
    """Token ids the engine takes as they are."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text they came from, when known: outputs report it
    cache_salt: NotRequired[str]


class ChatPrompt(TypedDict):
    """A conversation, rendered through the model's chat template before it reaches the engine
    (in the ingress when it has the tokenizer, else in the engine's replica)."""

    messages: list[dict[str, Any]]
    add_generation_prompt: NotRequired[bool]  # end with the assistant's turn opened (default True)
    tools: NotRequired[list[dict[str, Any]]]  # OpenAI's tool definitions, for the chat template
    cache_salt: NotRequired[str]


# A tenant's salt is mixed into its first block's hash, so tenants never share prefix-cache blocks.
MAX_CACHE_SALT_CHARS = 1024
# What travels with a prompt from the server's ingress to an engine replica besides the prompt
# itself: the tenant's salt, and the adapter a request's `model` named (a LoRARequest, which the
# replica takes out and hands the engine). A prompt that is tokenized or handed over keeps them.
PROMPT_EXTRAS = ("cache_salt", "lora_request")


def prompt_extras(prompt: object) -> dict[str, Any]:
    return {key: prompt[key] for key in PROMPT_EXTRAS if key in prompt} if isinstance(prompt, dict) else {}

PromptType = Union[str, TextPrompt, TokensPrompt]  # what the engine takes (LLM, AsyncLLM)
ServerPrompt = Union[PromptType, ChatPrompt]  # what an LLMServer replica takes


def tokens_prompt(token_ids: list[int], text: str | None = None) -> TokensPrompt:
    prompt = TokensPrompt(prompt_token_ids=token_ids)
    if text is not None:
        prompt["prompt"] = text
    return prompt


def is_tokens_prompt(prompt: object) -> TypeGuard[TokensPrompt]:
    """A dict prompt of token ids (their values are checked where they enter: the engine)."""
    return isinstance(prompt, dict) and "prompt_token_ids" in prompt


def is_chat_prompt(prompt: object) -> TypeGuard[ChatPrompt]:
    return isinstance(prompt, dict) and "messages" in prompt
