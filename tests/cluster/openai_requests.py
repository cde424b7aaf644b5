"""One request through the real openai client, whole or streamed, reduced to what a handover
must keep: each choice's text and the usage counts (the drain tests compare these with an
undisturbed run)."""

from __future__ import annotations

import asyncio

import openai


async def ask(
    client: openai.AsyncOpenAI, model: str, prompt: str, is_chat: bool, params: dict, started: asyncio.Event | None,
    received: list[int] | None = None,
) -> tuple[tuple[str, ...], int, int]:
    """(each choice's text by index, prompt_tokens, completion_tokens). Streamed unless `started`
    is None; a stream sets `started` at its first text, and adds each piece's length to
    `received[0]` (its progress, for a sender that waits on it)."""
    common = {"model": model, **params}
    messages = [{"role": "user", "content": prompt}]
    if started is None:
        if is_chat:
            body = await client.chat.completions.create(messages=messages, **common)
            texts = tuple(choice.message.content for choice in body.choices)
        else:
            body = await client.completions.create(prompt=prompt, **common)
            texts = tuple(choice.text for choice in body.choices)
        return texts, body.usage.prompt_tokens, body.usage.completion_tokens
    options = {"stream": True, "stream_options": {"include_usage": True}}
    if is_chat:
        response = await client.chat.completions.create(messages=messages, **common, **options)
    else:
        response = await client.completions.create(prompt=prompt, **common, **options)
    parts: dict[int, list[str]] = {}  # choice index -> its text, piece by piece
    usage = None
    async for chunk in response:
        for choice in chunk.choices:
            piece = (choice.delta.content if is_chat else choice.text) or ""
            parts.setdefault(choice.index, []).append(piece)
            started.set()
            if received is not None:
                received[0] += len(piece)
        if chunk.usage is not None:
            usage = chunk.usage
    return tuple("".join(parts[index]) for index in sorted(parts)), usage.prompt_tokens, usage.completion_tokens
