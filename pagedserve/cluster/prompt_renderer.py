"""Prompts turned into token ids in the ingress, before the LLMServer handle call: Serve's request
router sees a call's arguments, and the prefix-aware router needs the prompt's tokens (and
resumed requests are token ids too). Chat messages go through the model's chat template here.

The ingress loads the engine's tokenizer itself, once, and only the tokenizer (no weights, no GGUF
conversion: model_resolver.resolve_tokenizer_source) for the engine's `model` / `tokenizer` /
`revision` (asked of an LLMServer replica when the ingress starts, so the ingress's arguments do
not change). Text is length-checked against the engine's max_model_len before it is encoded, and
encoded on a thread of its own, never on the ingress's event loop (cluster/tokenizer_thread.py).
With the engine in the ingress's own process (`engine_host: ingress`) there is nothing to load:
the renderer takes the engine's tokenizer and its thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from pagedserve.cluster.tokenizer_thread import TokenizerThread
from pagedserve.inputs import ServerPrompt, is_chat_prompt, is_tokens_prompt, tokens_prompt

logger = logging.getLogger(__name__)


class PromptRenderer:
    def __init__(self, fetch_spec: Callable[[], Awaitable[dict[str, Any]]], tokenizer: TokenizerThread | None = None):
        """`fetch_spec`: returns LLMServer.prompt_spec() (the engine's model, tokenizer and revision).
        `tokenizer`: one already loaded in this process (the engine's): nothing is fetched or loaded."""
        self.fetch_spec = fetch_spec
        self._ready = tokenizer
        self._loading: asyncio.Task | None = None

    def start(self) -> None:
        """Begin loading now if an event loop runs here (Serve runs the ingress's constructor on
        its loop), so the first request does not wait for it."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._loading is None and self._ready is None:
            self._loading = asyncio.create_task(self._load())

    async def render(self, prompt: ServerPrompt) -> ServerPrompt:
        """The engine prompt for text or a ChatPrompt, or a TokensPrompt as given: a TokensPrompt
        with the text beside its ids where the tokenizer is at hand.
        A conversation the chat template rejects raises ValueError."""
        tokenizer = await self._tokenizer()
        if tokenizer is None or is_tokens_prompt(prompt):
            return prompt
        if isinstance(prompt, str):
            return tokens_prompt(await tokenizer.encode(prompt), prompt)
        if is_chat_prompt(prompt):
            return await tokenizer.render_chat(prompt["messages"], prompt.get("add_generation_prompt", True), prompt.get("tools"))
        return prompt

    async def _tokenizer(self) -> TokenizerThread | None:
        if self._ready is not None:
            return self._ready
        if self._loading is None:
            self._loading = asyncio.create_task(self._load())
        loading = self._loading
        tokenizer = await asyncio.shield(loading)
        if tokenizer is None and self._loading is loading:
            self._loading = None  # try again with the next request
        return tokenizer

    async def _load(self) -> TokenizerThread | None:
        """The tokenizer, or None (prompts then go as given and the replica tokenizes them:
        the service keeps working, routed by power of two)."""
        from pagedserve.engine.tokenizer import TextLimit, load_tokenizer
        from pagedserve.model_resolver import resolve_tokenizer_source

        try:
            spec = await self.fetch_spec()
            # The tokenizer only: a GGUF file's from its metadata, a hub model's tokenizer files.
            # Converting the checkpoint here would dequantize the whole model in the ingress.
            source = await asyncio.to_thread(resolve_tokenizer_source, spec["model"], spec.get("tokenizer"), spec.get("revision"))
            tokenizer = await asyncio.to_thread(load_tokenizer, str(source.folder), source.gguf_file)
            limit = await asyncio.to_thread(TextLimit.of, tokenizer, spec["max_model_len"])
            return TokenizerThread(tokenizer, limit)
        except Exception:
            logger.warning("cannot load the tokenizer in the ingress; replicas will tokenize", exc_info=True)
            return None
