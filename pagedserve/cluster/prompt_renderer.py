"""Prompts turned into token ids in the ingress, before the LLMServer handle call: Serve's request
router sees a call's arguments, and the prefix-aware router needs the prompt's tokens (and
resumed requests are token ids too). Chat messages go through the model's chat template here.

The ingress loads the engine's tokenizer itself, once, from the folder model_resolver resolves
for the engine's `model` / `tokenizer` / `revision` (asked of an LLMServer replica when the
ingress starts, so the ingress's arguments do not change).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from pagedserve.engine.chat import render_chat

logger = logging.getLogger(__name__)


class PromptRenderer:
    def __init__(self, fetch_spec: Callable[[], Awaitable[dict[str, Any]]]):
        """`fetch_spec`: returns LLMServer.prompt_spec() (the engine's model, tokenizer and revision)."""
        self.fetch_spec = fetch_spec
        self._loading: asyncio.Task | None = None

    def start(self) -> None:
        """Begin loading now if an event loop runs here (Serve runs the ingress's constructor on
        its loop), so the first request does not wait for it."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._loading is None:
            self._loading = asyncio.create_task(self._load())

    async def render(self, prompt: Any) -> Any:
        """The engine prompt for text, {"messages": [...], "add_generation_prompt": bool} or
        token ids: {"prompt": text, "prompt_token_ids": [...]} where the tokenizer is at hand.
        A conversation the chat template rejects raises ValueError."""
        tokenizer = await self._tokenizer()
        if tokenizer is None or (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            return prompt
        # Encoding runs on the event loop: one fast tokenizer used from two threads can fail.
        if isinstance(prompt, str):
            return {"prompt": prompt, "prompt_token_ids": tokenizer.encode(prompt)}
        if isinstance(prompt, dict) and "messages" in prompt:
            return render_chat(tokenizer, prompt["messages"], None, prompt.get("add_generation_prompt", True), prompt.get("tools"))
        return prompt

    async def _tokenizer(self) -> Any:
        if self._loading is None:
            self._loading = asyncio.create_task(self._load())
        loading = self._loading
        tokenizer = await asyncio.shield(loading)
        if tokenizer is None and self._loading is loading:
            self._loading = None  # try again with the next request
        return tokenizer

    async def _load(self) -> Any:
        """The tokenizer, or None (prompts then go as given and the replica tokenizes them:
        the service keeps working, routed by power of two)."""
        from pagedserve.engine.tokenizer import load_tokenizer
        from pagedserve.model_resolver import resolve_checkpoint

        try:
            spec = await self.fetch_spec()
            checkpoint = await asyncio.to_thread(resolve_checkpoint, spec["model"], spec.get("tokenizer"), spec.get("revision"))
            return await asyncio.to_thread(load_tokenizer, str(checkpoint.tokenizer_path))
        except Exception:
            logger.warning("cannot load the tokenizer in the ingress; replicas will tokenize", exc_info=True)
            return None
