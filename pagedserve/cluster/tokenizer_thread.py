"""A tokenizer that works off the event loop: encoding, chat templates and decoding run on one
worker thread of its own, after a length check.

Encoding costs about 0.5 s per MB of text: on the event loop, one large prompt froze every stream
and /health of the ingress or replica (issue 19). One thread, not a pool: a fast tokenizer used
from two threads at once can fail ("Already borrowed"), so every use of this tokenizer goes
through this thread, and the calls queue up there instead of on the loop.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from pagedserve.engine.chat import render_chat
from pagedserve.engine.tokenizer import TextLimit, num_message_chars

T = TypeVar("T")


class TokenizerThread:
    def __init__(self, tokenizer: Any, limit: TextLimit):
        """`limit`: TextLimit.of(tokenizer, max_model_len), computed off the loop by the caller."""
        self.tokenizer = tokenizer
        self.limit = limit
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer")

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; ValueError, before any encoding, for text that cannot fit in max_model_len."""
        self.limit.check(len(text), "prompt")
        return await self._run(functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens))

    async def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The conversation (and its tools) through the chat template (engine/chat.py),
        length-checked first (the tools have bounds of their own: cluster/tool_requests.py)."""
        self.limit.check(num_message_chars(messages), "messages")
        return await self._run(functools.partial(render_chat, self.tokenizer, messages, None, add_generation_prompt, tools))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._run(functools.partial(self.tokenizer.decode, token_ids))

    async def _run(self, call: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, call)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)
