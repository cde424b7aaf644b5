"""The engine in the ingress replica's own process (`engine_host: ingress`).

By default the engine's `AsyncLLM` runs in LLMServer replicas, and the ingress reaches them
through a Serve handle: every request is a call to another process, and every streamed item a
message back. With one engine and no scaling, nothing needs that hop, and vLLM's API server has
none: its HTTP server, detokenizer and output processing share a process, the engine core runs
in another. `engine_host: ingress` builds the same layout: the ingress replica constructs the
`LLMServer` itself and calls it directly, while the engine core still runs in a process of its
own (`engine_core_process`). A request's path loses the handle call (routing, a gRPC message, the
replica's dispatch) and each streamed item its serialization.

What the ingress calls on a deployment handle (`handle.method.remote(...)`, awaited) it calls
here the same way, so the routes do not branch on where the engine runs. What a separate
deployment brings is gone with it: replicas to scale or route between, streams handed over on
a drain (there is no other replica to take them), Serve's queue in front of the replica
(admission is the engine's own `max_waiting_requests`).
"""

from __future__ import annotations

import inspect
from typing import Any, AsyncIterator

from pagedserve.cluster.stream_items import StreamItem
from pagedserve.inputs import ServerPrompt
from pagedserve.sampling_params import SamplingParams


class LocalServer:
    """An LLMServer in this process, reached like a deployment handle: `await server.m.remote(*a)`."""

    def __init__(self, server: Any):
        self.server = server

    def __getattr__(self, name: str) -> LocalMethod:
        if name.startswith("__"):  # pickling and copying probe dunders: this object stays here
            raise AttributeError(name)
        return LocalMethod(getattr(self.server, name))

    def check_health(self) -> None:
        """Raises while the engine is dead (the ingress's own health check, so Serve replaces it)."""
        self.server.check_health()


class LocalMethod:
    def __init__(self, method: Any):
        self.method = method

    async def remote(self, *args: Any, **kwargs: Any) -> Any:
        result = self.method(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result


class LocalEngineClient:
    """The ingress's EngineClient for a LocalServer: its `generate` stream, iterated directly
    (not through handover.ResumingClient, which races every read against a replica leaving)."""

    def __init__(self, server: LocalServer):
        self.server = server.server

    async def generate(self, request_id: str, prompt: ServerPrompt, params: SamplingParams, resume: Any = None) -> AsyncIterator[StreamItem]:
        stream = self.server.generate(request_id, prompt, params, resume)
        try:
            async for item in stream:
                yield item
        finally:  # a client that went away: closing the stream aborts the engine request
            await stream.aclose()
