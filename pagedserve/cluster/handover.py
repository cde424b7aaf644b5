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
import importlib
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

from pagedserve.cluster.llm_server import ErrorInfo, Handover, overloaded
from pagedserve.engine.fan_out import child_params
from pagedserve.engine.input_processor import ResumeState
from pagedserve.engine.request_output import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("ray.serve")  # into the replica's log, beside Serve's own replica news

MAX_REMEMBERED_LEAVING = 1024  # leaving replica ids kept (each is unique; a few per redeploy)
HANDED_OVER = object()  # what `_next_or_leaving` returns when the replica left first
# For a stream that cannot move (its final item came) or has nowhere to (the app is being deleted).
STOPPED = overloaded("the engine replica serving this request stopped; retry later")


class HandoverRegistry:
    """Process-local (one per ingress process): which replica serves each watched engine request,
    and which replicas are leaving. Thread-safe: Serve's router runs on its own event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replica_of: dict[str, str] = {}  # engine request id -> replica id
        self._watchers: dict[str, Callable[[], None]] = {}  # engine request id -> called when its replica leaves
        self._leaving: OrderedDict[str, None] = OrderedDict()  # replica ids, oldest first

    def watch(self, request_id: str, on_leaving: Callable[[], None]) -> None:
        """`on_leaving` is called (from any thread) once the request's replica is leaving."""
        with self._lock:
            self._watchers[request_id] = on_leaving

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._watchers.pop(request_id, None)
            self._replica_of.pop(request_id, None)

    def routed(self, request_id: str, replica_id: str) -> None:
        with self._lock:
            if request_id not in self._watchers:
                return  # not a request this process watches (or already done)
            self._replica_of[request_id] = replica_id
            watcher = self._watchers[request_id] if replica_id in self._leaving else None
        if watcher is not None:  # routed just before its replica left
            watcher()

    def replica_of(self, request_id: str) -> str | None:
        with self._lock:
            return self._replica_of.get(request_id)

    def mark_leaving(self, replica_ids: Iterable[str]) -> None:
        leaving = set(replica_ids)
        with self._lock:
            for replica_id in leaving:
                self._leaving[replica_id] = None
            while len(self._leaving) > MAX_REMEMBERED_LEAVING:
                self._leaving.popitem(last=False)
            watchers = [self._watchers[r] for r, replica in self._replica_of.items() if replica in leaving and r in self._watchers]
        for watcher in watchers:
            watcher()

    def is_leaving(self, replica_id: str) -> bool:
        with self._lock:
            return replica_id in self._leaving


REGISTRY = HandoverRegistry()


def _registry() -> HandoverRegistry:
    """The process's registry, for the router. Serve pickles a router class's module by value,
    so the router's copy of this module's globals would be its own: it looks the real module up
    in the process it runs in (the ingress's, where `ResumingClient` watches the same one)."""
    return importlib.import_module(__name__).REGISTRY


class HandoverMixin:
    """For a Serve `RequestRouter` of the LLMServer deployment: publishes leaving replicas and
    where each `generate` call went, and never routes to a replica that is leaving. Put it first
    among the bases; the router's own hooks run through super()."""

    def update_replicas(self, replicas: list[Any]) -> None:
        """Replicas removed from the running set, and those whose routing stats say they drain
        (sent SIGTERM, they stay in the set until their process exits), are leaving."""
        before = {replica_id.unique_id for replica_id in self._replica_id_set}
        super().update_replicas(replicas)
        removed = before - {replica.replica_id.unique_id for replica in replicas}
        draining = {replica.replica_id.unique_id for replica in replicas if (replica.routing_stats or {}).get("is_draining")}
        registry = _registry()
        leaving = {replica_id for replica_id in removed | draining if not registry.is_leaving(replica_id)}
        if leaving:
            logger.info("replicas leaving: %s; handing their streams over", sorted(leaving))
            registry.mark_leaving(leaving)

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        if pending_request.metadata.call_method == "generate" and pending_request.args:
            _registry().routed(str(pending_request.args[0]), replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        registry = _registry()
        ranks = [[r for r in rank if not registry.is_leaving(r.replica_id.unique_id)] for rank in ranks]
        return [rank for rank in ranks if rank]  # none left: the router backs off and asks again


class PowerOfTwoRouter(HandoverMixin, PowerOfTwoChoicesRequestRouter):
    """Serve's default power-of-two-choices router, with handover."""


@dataclass
class _Choice:
    """What the client has of one choice (one of a request's n samples)."""

    output_token_ids: list[int] = field(default_factory=list)
    num_sent_chars: int = 0
    cumulative_logprob: float | None = None
    is_finished: bool = False

    def record(self, completion: CompletionOutput) -> None:
        self.output_token_ids += completion.token_ids
        self.num_sent_chars += len(completion.text)
        self.cumulative_logprob = completion.cumulative_logprob
        self.is_finished = self.is_finished or completion.finish_reason is not None

    def resume(self) -> ResumeState:
        return ResumeState(list(self.output_token_ids), self.num_sent_chars, self.cumulative_logprob)


@dataclass
class _Progress:
    """What the client has of one engine request so far (DELTA streams), choice by choice."""

    prompt_token_ids: list[int] | None = None  # from the first item
    choices: dict[int, _Choice] = field(default_factory=dict)  # by choice index
    num_items: int = 0
    is_finished: bool = False  # the final item arrived: only the stream's end is left to read

    def record(self, output: RequestOutput) -> None:
        if self.prompt_token_ids is None:
            self.prompt_token_ids = list(output.prompt_token_ids)
        self.num_items += 1
        for completion in output.outputs:
            self.choices.setdefault(completion.index, _Choice()).record(completion)
        self.is_finished = self.is_finished or output.finished

    def can_move(self, params: SamplingParams) -> bool:
        """Nothing sent yet: start again anywhere. Else only a stream (DELTA outputs) resumes,
        and not once its final item arrived (a resume would have no tokens left to make)."""
        if self.is_finished:
            return False
        return self.num_items == 0 or params.output_kind == RequestOutputKind.DELTA

    def resume(self) -> ResumeState | None:
        """The ResumeState of a one-sample request; None: nothing sent, start again."""
        if self.num_items == 0:
            return None
        return self.choices.get(0, _Choice()).resume()

    def unfinished_choices(self, n: int) -> dict[int, _Choice]:
        """By index, the choices of an n-sample request still to finish (a new one if none came)."""
        choices = {i: self.choices.get(i) or _Choice() for i in range(n)}
        return {i: choice for i, choice in choices.items() if not choice.is_finished}


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
        self, request_id: str, prompt: Any, params: SamplingParams, progress: _Progress | None = None
    ) -> AsyncIterator[Any]:
        """`progress`: what the client already has (a choice of an n > 1 request that moved)."""
        progress = progress or _Progress()
        num_attempts = 0
        while True:
            engine_id = request_id if num_attempts == 0 else f"{request_id}~handover{num_attempts}"
            resume = progress.resume()
            prompt_now = prompt if resume is None else {"prompt_token_ids": progress.prompt_token_ids}
            num_attempts += 1
            is_moved = False
            async for item in self._attempt(engine_id, prompt_now, params, resume, progress):
                if item is HANDED_OVER:
                    is_moved = True
                else:
                    yield item
            if not is_moved:
                return
            logger.info("request %s (n=%d) handed over after %d items", request_id, params.n, progress.num_items)
            if params.n > 1 and progress.num_items > 0:
                async for item in self._choices(f"{request_id}~handover{num_attempts}", params, progress):
                    yield item
                return

    async def _choices(self, request_id: str, params: SamplingParams, progress: _Progress) -> AsyncIterator[Any]:
        """An n > 1 stream's unfinished choices, each as its own resumed one-sample request,
        merged back into the request's outputs (the choice's index, `finished` once all are)."""
        choices = progress.unfinished_choices(params.n)
        prompt = {"prompt_token_ids": progress.prompt_token_ids}
        streams = []
        for index, choice in choices.items():
            one = _Progress(progress.prompt_token_ids, {0: choice}, progress.num_items) if choice.output_token_ids else None
            streams.append(self.generate(f"{request_id}-{index}", prompt, child_params(params, index), one))
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
        self, engine_id: str, prompt: Any, params: SamplingParams, resume: ResumeState | None, progress: _Progress
    ) -> AsyncIterator[Any]:
        """One engine request's items, until it ends or (yielding HANDED_OVER) its replica leaves."""
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
                    item = HANDED_OVER if can_move else STOPPED
                if item is HANDED_OVER:
                    yield HANDED_OVER
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


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """Items of several streams as they come, each with its stream's position in `streams`. An
    exception in a stream ends the merge with it; closing the merge closes every stream."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(position: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((position, item))
            await queue.put((position, done))
        except Exception as error:  # surfaced by the merge, in its consumer's task
            await queue.put((position, _Failed(error)))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_left = len(tasks)
        while num_left:
            position, item = await queue.get()
            if isinstance(item, _Failed):
                raise item.error
            if item is done:
                num_left -= 1
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # each stream's own cleanup runs


@dataclass(frozen=True)
class _Failed:
    error: Exception


async def _next_or_leaving(stream: AsyncIterator[Any], leaving_wait: asyncio.Future, can_move: Callable[[], bool]) -> Any:
    """The stream's next item (None at its end), or HANDED_OVER if its replica leaves first and
    the request can move; the pending read is cancelled then."""
    next_item = asyncio.ensure_future(anext(stream, None))
    waits = {next_item, leaving_wait} if can_move() else {next_item}
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    if next_item in done:
        return next_item.result()
    next_item.cancel()
    try:
        await next_item
    except (asyncio.CancelledError, Exception):  # the cancelled read's own ending
        pass
    return HANDED_OVER


def is_stopped_by_serve(error: BaseException) -> bool:
    """A replica's actor error because Serve's controller ended it (`ray.kill` after the
    graceful-shutdown period), as opposed to a crash (a killed process, a lost node)."""
    return "killed by `ray.kill`" in str(error)
