"""The LLMServer deployment, reached through its Serve handle, as the ingress's EngineClient."""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
from typing import Any, AsyncIterator

from pagedserve.cluster.ray_internals import actor_death, is_stopped_by_serve, own_internal_request_id
from pagedserve.cluster.stream_items import Handover, StreamItem, overloaded
from pagedserve.inputs import ServerPrompt
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
APP_STATUS_MAX_AGE_S = 1.0  # how long one look at the app's status answers whether it is being deleted

# Serve's gRPC transport receives messages of at most 4 MiB by default (Ray 2.60: a 7 MB argument
# and a 7 MB stream item both fail with gRPC's RESOURCE_EXHAUSTED). Calls whose arguments pickle
# past GRPC_ARGS_MAX_BYTES (a prompt of a quarter million characters) go by reference instead,
# through Ray's actor calls and object store: the replica's limit is its own, set where it starts.
GRPC_ARGS_MAX_BYTES = 1 << 20
# The answers have no such bound: a non-streaming answer is one item, and n=8 x 1500 tokens with
# 20 logprobs each pickles past 4 MiB (a 503 after the whole generation, before this). So the
# ingress, the receiving end, takes items up to gRPC's largest message. Serve reads the limit from
# its environment when the process starts, hence an environment variable (`ingress_env_vars`).
GRPC_ANSWER_MAX_BYTES = 2**31 - 1
GRPC_RECEIVE_LIMIT_VARIABLE = "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"
# Over gRPC a stopped replica and a crashed one both end a stream with "actor unavailable"; the
# GCS's record of the actor's death tells them apart. It may land a moment after the stream ends.
DEATH_RECORD_WAIT_S = 5.0
DEATH_RECORD_POLL_S = 0.1
TRANSPORTS = ("grpc", "actor")


class ServeEngineClient:
    """The LLMServer deployment as an EngineClient: a streaming handle call per request, over
    Serve's gRPC transport (`transport="grpc"`, the default: 1.05-1.12x the output tokens a second
    of actor calls at saturation on 2 cores, benchmarks/results/serve_transport/) or Ray's actor
    calls (`"actor"`)."""

    def __init__(self, handle: Any, transport: str = "grpc"):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
        self.handle = handle.options(stream=True)
        self.grpc_handle = handle.options(stream=True, _by_reference=False) if transport == "grpc" else None
        self._deleting: asyncio.Future | None = None  # the latest look at the app's status
        self._deleting_since = 0.0
        self._deaths: dict[str, asyncio.Future] = {}  # per replica actor: was it stopped by Serve?

    async def is_shutting_down(self) -> bool:
        """Whether this application is being deleted (ResumingClient asks when a replica
        leaves: then none will take its streams over, and they finish where they are). The
        streams of a leaving replica ask together: one look at the controller answers them all."""
        now = time.monotonic()
        if self._deleting is None or now - self._deleting_since > APP_STATUS_MAX_AGE_S:
            self._deleting, self._deleting_since = asyncio.ensure_future(asyncio.to_thread(_is_app_deleting)), now
        return await asyncio.shield(self._deleting)

    async def generate(self, request_id: str, prompt: ServerPrompt, params: SamplingParams, resume: Any = None) -> AsyncIterator[StreamItem]:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError

        args = (request_id, prompt, params, resume)
        with own_internal_request_id():
            responses = self._handle_for(args).generate.remote(*args)
        try:
            async for item in responses:
                yield item
        except BackPressureError:
            yield overloaded("the server is overloaded: too many requests are queued; retry later")
        except RayActorError as error:  # the replica's process ended (stopped, crashed, a lost node)
            if await self._stopped_by_serve(error):  # stopped, not crashed: another replica goes on
                yield Handover()
                return
            logger.warning("request %s lost its LLMServer replica: %s", request_id, type(error).__name__)
            yield overloaded("the engine replica serving this request died; retry later")
        except grpc_errors() as error:  # gRPC's own failure, not a replica's end (those are RayActorErrors)
            logger.warning("request %s: the gRPC call to its LLMServer replica failed: %s", request_id, error.code().name)
            yield overloaded(f"the call to the engine replica failed (gRPC {error.code().name}); retry later")
        finally:
            responses.cancel()  # a client that went away: the replica aborts the request

    def _handle_for(self, args: tuple) -> Any:
        """gRPC where its 4 MiB messages hold the call, else by reference."""
        if self.grpc_handle is None:
            return self.handle
        try:
            size = len(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:  # only cloudpickle can (Serve's own serializer): measure no further
            return self.handle
        return self.grpc_handle if size <= GRPC_ARGS_MAX_BYTES else self.handle

    async def _stopped_by_serve(self, error: BaseException) -> bool:
        """Whether the replica behind `error` was ended by Serve (`ray.kill`) rather than lost.
        Ray's actor calls say so in the error's text; over gRPC, the GCS's death record says it.
        The streams of one replica ask together."""
        actor_id = getattr(error, "actor_id", None)
        if is_stopped_by_serve(error) or not actor_id:
            return is_stopped_by_serve(error)
        look = self._deaths.get(actor_id)
        if look is None:
            if len(self._deaths) > 64:  # replicas long gone
                self._deaths = {key: look for key, look in self._deaths.items() if not look.done()}
            look = self._deaths[actor_id] = asyncio.ensure_future(_death_reason(actor_id))
        reason = await asyncio.shield(look)
        if reason is None and self._deaths.get(actor_id) is look:
            del self._deaths[actor_id]  # it read as alive: its later end is asked about afresh
        return reason == "RAY_KILL"


def ingress_env_vars() -> dict[str, str]:
    """The environment the ingress's process needs for the gRPC transport (app.py sets it)."""
    return {GRPC_RECEIVE_LIMIT_VARIABLE: str(GRPC_ANSWER_MAX_BYTES)}


def grpc_errors() -> tuple[type[BaseException], ...]:
    """What a call over Serve's gRPC transport raises when gRPC itself fails (a message past its
    size limit, an internal error). A lost connection is Ray's ActorUnavailableError instead."""
    import grpc

    return (grpc.aio.AioRpcError,)


async def _death_reason(actor_id: str) -> str | None:
    """The GCS's reason for the actor's end, waiting DEATH_RECORD_WAIT_S for it to be recorded;
    None if it still reads as alive then (unreachable for a while: treated as lost)."""
    deadline = time.monotonic() + DEATH_RECORD_WAIT_S
    while True:
        try:
            reason = await asyncio.to_thread(actor_death, actor_id)
        except Exception:  # the GCS did not answer: no record, so not known to be a stop
            logger.warning("could not read the GCS's record of actor %s", actor_id, exc_info=True)
            return None
        if reason is not None or time.monotonic() >= deadline:
            return reason
        await asyncio.sleep(DEATH_RECORD_POLL_S)


def _is_app_deleting() -> bool:
    from ray import serve

    try:
        app = serve.status().applications.get(serve.get_replica_context().app_name)
    except Exception:  # the controller did not answer: assume a replica will take the stream
        logger.warning("could not read the application's status", exc_info=True)
        return False
    return app is None or app.status == "DELETING"
