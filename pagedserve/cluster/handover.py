"""A drain that hands streams over: when an LLMServer replica is about to stop (a downscale, a
redeploy, a drain it started itself), its in-flight requests go on on another replica instead of
running out the grace period or failing.

A request's truth is its prompt plus the tokens generated so far, so any replica can recompute
the KV and go on. The ingress holds the client's connection and knows exactly what it sent, so
it is where the handover happens:

1. Serve's controller removes a stopping replica from the running set it broadcasts to every
   handle's router (before the replica's graceful-shutdown wait). `HandoverMixin`, mixed into
   the LLMServer deployment's `RequestRouter`, sees the set shrink in `update_replicas` and which
   replica each request went to in `on_request_routed`, and publishes both to the process-local
   `REGISTRY`.
   A replica that drains on its own (sent SIGTERM: cluster/replica_drain.py) says so in its
   routing stats, and the mixin marks it leaving the same way.
2. Should the news come late (a busy controller) and Serve force-kill the replica after its grace
   period, the stream ends with a `Handover` item instead of a crash's error (ServeEngineClient
   tells the two apart); the ingress marks the replica leaving and goes on as in 3. A draining
   replica ends its streams, and answers new requests, with a `Handover` item itself.
3. `ResumingClient` (the ingress's EngineClient) watches its streams' replicas: when one leaves,
   it cancels the stream there (the engine aborts it, so the replica drains at once) and issues
   the request again, with a `ResumeState` of what the client already has; the router sends it to
   a replica that stays. The client's stream goes on with no gap and nothing repeated. A stream
   of n > 1 samples moves as one resumed request per choice (see `ResumingClient`).
4. A redeploy that changes the app's args replaces the ingress too: the old ingress replica keeps
   its streams (app.py gives it a long grace period) while they move from old LLMServer replicas
   to new ones, which its router sees like any other. When the app is being deleted nothing
   moves: streams finish where they are, within the replicas' grace period.

A crash (the replica's process gone) is not a handover: Serve's router drops a dead replica
through `on_replica_actor_died`, not `update_replicas`, and its streams end with an error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Union

from pagedserve.cluster.handover_registry import REGISTRY, HandoverRegistry
from pagedserve.cluster.stream_items import Handover, StreamItem, overloaded
from pagedserve.cluster.stream_merge import merge_streams
from pagedserve.cluster.stream_progress import StreamProgress
from pagedserve.cluster.stream_race import RIVAL_FIRST, next_unless
from pagedserve.engine.fan_out import child_params
from pagedserve.engine.input_processor import ResumeState
from pagedserve.engine.request_output import RequestOutput
from pagedserve.inputs import ServerPrompt, TokensPrompt, prompt_extras, tokens_prompt
from pagedserve.request_ids import choice_request_id, handover_request_id
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")  # into the replica's log, beside Serve's own replica news

# For a stream that cannot move (its final item came) or has nowhere to (the app is being deleted).
STOPPED = overloaded("the engine replica serving this request stopped; retry later")


@dataclass(frozen=True)
class Moved:
    """An attempt's last item when its replica left first and the request can move on: the
    client issues it again, elsewhere. It never leaves `ResumingClient`."""


AttemptItem = Union[StreamItem, Moved]  # what one attempt (one engine request) yields


def _resumed_prompt(prompt: ServerPrompt, prompt_token_ids: list[int]) -> TokensPrompt:
    """A resumed request's prompt: its token ids, its tenant's prefix-cache salt (without it, the
    new replica would cache the tenant's blocks where every unsalted prompt can hit them) and its
    adapter (the new replica loads it)."""
    resumed = tokens_prompt(prompt_token_ids)
    resumed.update(prompt_extras(prompt))
    return resumed


class ResumingClient:
    """An EngineClient whose streams survive their replica leaving (see the module's note).

    A stream of n > 1 samples that has sent text moves as n one-sample requests, one per choice
    not finished yet, each resuming from what the client has of it: the engine runs a request's
    n samples as n requests anyway (engine/fan_out.py: choice i has the seed `seed + i`),
    so greedy and seeded choices go on exactly as undisturbed; each can move again later."""

    def __init__(self, client: Any, registry: HandoverRegistry = REGISTRY):
        self.client = client
        self.registry = registry

    async def generate(
        self, request_id: str, prompt: ServerPrompt, params: SamplingParams, progress: StreamProgress | None = None
    ) -> AsyncIterator[StreamItem]:
        """`progress`: what the client already has (a choice of an n > 1 request that moved)."""
        progress = progress or StreamProgress()
        num_attempts = 0
        while True:
            engine_id = handover_request_id(request_id, num_attempts)
            resume = progress.resume()
            prompt_now = prompt if resume is None else _resumed_prompt(prompt, progress.prompt_token_ids)
            num_attempts += 1
            is_moved = False
            async for item in self._attempt(engine_id, prompt_now, params, resume, progress):
                if isinstance(item, Moved):
                    is_moved = True
                else:
                    yield item
            if not is_moved:
                return
            logger.info("request %s (n=%d) handed over after %d items", request_id, params.n, progress.num_items)
            if params.n > 1 and progress.num_items > 0:
                async for item in self._choices(handover_request_id(request_id, num_attempts), prompt, params, progress):
                    yield item
                return

    async def _choices(
        self, request_id: str, prompt: ServerPrompt, params: SamplingParams, progress: StreamProgress
    ) -> AsyncIterator[StreamItem]:
        """An n > 1 stream's unfinished choices, each as its own resumed one-sample request,
        merged back into the request's outputs (the choice's index, `finished` once all are)."""
        choices = progress.unfinished_choices(params.n)
        prompt = _resumed_prompt(prompt, progress.prompt_token_ids)
        streams = []
        for index, choice in choices.items():
            one = StreamProgress(progress.prompt_token_ids, {0: choice}, progress.num_items) if choice.output_token_ids else None
            streams.append(self.generate(choice_request_id(request_id, index), prompt, child_params(params, index), one))
        num_left = len(choices)
        async for position, item in merge_streams(streams):
            if not isinstance(item, RequestOutput):
                yield item  # an ErrorInfo: the consumer ends the response with it
                continue
            index = list(choices)[position]
            outputs = [dataclasses.replace(completion, index=index) for completion in item.outputs]
            num_left -= sum(completion.finish_reason is not None for completion in outputs)
            yield dataclasses.replace(item, request_id=request_id, outputs=outputs, finished=num_left == 0)

    async def _attempt(
        self, engine_id: str, prompt: ServerPrompt, params: SamplingParams, resume: ResumeState | None, progress: StreamProgress
    ) -> AsyncIterator[AttemptItem]:
        """One engine request's items, until it ends or (yielding Moved) its replica leaves."""
        loop = asyncio.get_running_loop()
        leaving = asyncio.Event()

        def on_leaving() -> None:  # called from the router's thread
            try:
                loop.call_soon_threadsafe(leaving.set)
            except RuntimeError:  # this event loop is closed: nobody reads the stream any more
                pass

        self.registry.watch(engine_id, on_leaving)
        stream = self.client.generate(engine_id, prompt, params, resume)
        leaving_wait = asyncio.ensure_future(self._until_moving(leaving))
        try:
            while True:
                item = await _next_or_leaving(stream, leaving_wait, lambda: progress.can_move(params))
                if item is None:
                    return
                if isinstance(item, Handover):
                    self.registry.mark_leaving([item.replica_id or self.registry.replica_of(engine_id) or ""])
                    if progress.is_finished:
                        return  # its final item came: the client has it all
                    can_move = progress.can_move(params) and not await self._is_shutting_down()
                    item = Moved() if can_move else STOPPED
                if isinstance(item, Moved):
                    yield item
                    return
                if isinstance(item, RequestOutput):
                    progress.record(item)
                yield item
        finally:
            leaving_wait.cancel()
            self.registry.forget(engine_id)
            await stream.aclose()  # cancels the handle call: the leaving replica aborts it

    async def _until_moving(self, leaving: asyncio.Event) -> None:
        """Returns once the request's replica is leaving and another will take it over; while
        the app shuts down it never returns (the read it races is not disturbed meanwhile)."""
        await leaving.wait()
        if await self._is_shutting_down():
            await asyncio.Event().wait()

    async def _is_shutting_down(self) -> bool:
        """Whether the engine's deployment is going away for good (its app is being deleted):
        then no replica will take the request over, and a stream on a leaving replica finishes
        there, within its grace period. A client that cannot tell says no."""
        check = getattr(self.client, "is_shutting_down", None)
        return bool(check is not None and await check())

async def _next_or_leaving(
    stream: AsyncIterator[StreamItem], leaving_wait: asyncio.Future, can_move: Callable[[], bool]
) -> AttemptItem | None:
    """The stream's next item (None at its end), or Moved if its replica leaves first and
    the request can move; the pending read is cancelled then."""
    item = await next_unless(stream, leaving_wait if can_move() else None)
    return Moved() if item is RIVAL_FIRST else item
