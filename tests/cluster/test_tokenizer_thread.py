"""Tokenization off the event loop, after a length check (issue 19: the ingress encoded on its
loop, about 0.5 s per MB, and only the engine checked length; /tokenize checked nothing).

A tokenizer slowed on purpose stands in for a large prompt: the tiny test models' max_model_len
allows only a few kilobytes of text, which encode in microseconds."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from pagedserve.cluster.prompt_renderer import PromptRenderer
from pagedserve.engine.tokenizer import TextLimit, longest_token_chars

MAX_MODEL_LEN = 100
LONGEST_ENTRY = "<|longest|>"  # 11 characters
ENCODE_S = 1.0


class SlowTokenizer:
    """A tokenizer whose every encode takes ENCODE_S (as 2 MB of text would) and is counted."""

    def __init__(self):
        self.num_encoded = 0

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "ab": 1, LONGEST_ENTRY: 2}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.num_encoded += 1
        time.sleep(ENCODE_S)
        return [0] * min(len(text), 5)

    def apply_chat_template(self, messages, chat_template=None, add_generation_prompt=True, tokenize=False) -> str:
        return "".join(m["content"] for m in messages)


@pytest.fixture
def slow_renderer(monkeypatch):
    """A PromptRenderer as the ingress makes it, loading the slow tokenizer."""
    tokenizer = SlowTokenizer()
    monkeypatch.setattr("pagedserve.engine.tokenizer.load_tokenizer", lambda path, gguf_file=None: tokenizer)
    monkeypatch.setattr(
        "pagedserve.model_resolver.resolve_tokenizer_source", lambda *args: SimpleNamespace(folder="unused", gguf_file=None)
    )

    async def fetch_spec():
        return {"model": "m", "tokenizer": None, "revision": None, "max_model_len": MAX_MODEL_LEN}

    return PromptRenderer(fetch_spec), tokenizer


async def _worst_loop_latency(task: asyncio.Task) -> float:
    """The longest a 10 ms sleep on this loop overran while `task` ran: what /health would wait."""
    worst = 0.0
    while not task.done():
        start = time.monotonic()
        await asyncio.sleep(0.01)
        worst = max(worst, time.monotonic() - start - 0.01)
    return worst


@pytest.mark.parametrize("prompt", ["x" * 1000, {"messages": [{"role": "user", "content": "x" * 1000}], "add_generation_prompt": True}])
def test_encoding_leaves_the_event_loop_free(slow_renderer, prompt):
    renderer, tokenizer = slow_renderer

    async def main():
        await renderer.render("warm up: loads the tokenizer")
        render = asyncio.ensure_future(renderer.render(prompt))
        started = time.monotonic()
        worst = await _worst_loop_latency(render)
        return await render, worst, time.monotonic() - started

    rendered, worst, elapsed = asyncio.run(main())
    assert rendered["prompt_token_ids"] == [0] * 5 and tokenizer.num_encoded == 2
    assert elapsed >= ENCODE_S * 0.9  # the slow encode really ran meanwhile
    assert worst < 0.2, f"the event loop stalled {worst:.2f} s while a prompt was encoded"


@pytest.mark.parametrize(
    "prompt, field",
    [("x" * 1101, "prompt"), ({"messages": [{"role": "user", "content": "x" * 600}] * 2, "add_generation_prompt": True}, "messages")],
)
def test_text_too_long_to_fit_is_refused_unencoded(slow_renderer, prompt, field):
    renderer, tokenizer = slow_renderer
    with pytest.raises(ValueError) as info:
        asyncio.run(renderer.render(prompt))
    message = str(info.value)
    assert message.startswith(f"{field}: ") and "1100 that can fit in max_model_len=100 tokens" in message, message
    assert tokenizer.num_encoded == 0
    assert asyncio.run(renderer.render("x" * 1100))["prompt_token_ids"]  # at the limit: encoded


def test_longest_token_chars_of_a_real_tokenizer(tokenizer):
    longest = longest_token_chars(tokenizer)
    assert longest == max(len(entry) for entry in tokenizer.get_vocab()) and longest >= len("<|assistant|>")
    # No text of max_model_len x longest characters encodes to more tokens than characters/longest.
    text = "the quick brown fox, 日本語 🙂 " * 40
    assert len(tokenizer.encode(text)) >= len(text) / longest
    assert TextLimit.of(tokenizer, 512).max_chars == 512 * longest
