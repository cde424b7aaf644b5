"""The engine in the ingress replica's own process (`engine_host: ingress`).

By default the engine's `AsyncLLM` runs in LLMServer replicas, and the ingress reaches them
through a Serve handle: every request is a call to another process, and every streamed item a
message back. With one engine and no scaling, nothing needs that hop, and vLLM's API server has
none: its HTTP server, detokenizer and output processing share a process, the engine core runs
in another. `engine_host: ingress` builds the same layout: the ingress replica constructs the
`LLMServer` itself and calls it directly, while the engine core still runs in a process of its
own (`engine_core_process`). A request's path loses the handle call (routing, a gRPC message, the
replica's dispatch) and each streamed item its serialization. The metrics hub lives in the same
process too (`LocalHub`): with one engine there is no other replica's statistics to gather, and a
replica of its own was a Ray worker process beside the model's cores, woken by the engine's
report every second. Without it an idle server uses 5.5-6.3% of a core against 7.6-8.3%, 154 MiB
less memory, and starts 0.2-0.7 s sooner (2-core Zen 5, two starts each; docs/benchmarks.md).

What the ingress calls on a deployment handle (`handle.method.remote(...)`, awaited) it calls
here the same way, so the routes do not branch on where the engine runs. What a separate
deployment brings is gone with it: replicas to scale or route between, streams handed over on
a drain (there is no other replica to take them), Serve's queue in front of the replica
(admission is the engine's own `max_waiting_requests`).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, AsyncIterator, Generator

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


class LocalHub:
    """A MetricsHub in this process, reached like its deployment's handle: `await hub.m.remote(*a)`
    on the event loop (the routes), `hub.m.remote(*a).result(timeout_s=...)` from the engine's
    statistics thread (LLMServer._report_stats). One lock keeps the two threads' calls apart; each
    is a few dictionary updates, or rendering /metrics. Its state ends with the process, as the
    engine's does: a replaced ingress starts its counters and adapter ids afresh, and no engine
    still binds an old id (the deployment hub outlives ingresses for engines that do)."""

    def __init__(self, hub: Any):
        self.hub = hub
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> LocalHubMethod:
        if name.startswith("__"):
            raise AttributeError(name)
        return LocalHubMethod(getattr(self.hub, name), self.lock)


class LocalHubMethod:
    def __init__(self, method: Any, lock: threading.Lock):
        self.method, self.lock = method, lock

    def remote(self, *args: Any, **kwargs: Any) -> Done:
        with self.lock:
            return Done(self.method(*args, **kwargs))


class Done:
    """A call already answered, read the two ways a Serve DeploymentResponse is: awaited, or
    through `result()`."""

    def __init__(self, value: Any):
        self.value = value

    def __await__(self) -> Generator[Any, None, Any]:
        return self.value
        yield  # a generator that returns at once: awaiting it never suspends

    def result(self, timeout_s: float | None = None) -> Any:
        return self.value
