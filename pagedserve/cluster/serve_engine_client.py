"""The LLMServer deployment, reached through its Serve handle, as the ingress's EngineClient."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from pagedserve.cluster.ray_internals import is_stopped_by_serve, own_internal_request_id
from pagedserve.cluster.stream_items import Handover, StreamItem, overloaded
from pagedserve.inputs import ServerPrompt
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
APP_STATUS_MAX_AGE_S = 1.0  # how long one look at the app's status answers whether it is being deleted


class ServeEngineClient:
    """The LLMServer deployment as an EngineClient: a streaming handle call per request."""

    def __init__(self, handle: Any):
        self.handle = handle.options(stream=True)
        self._deleting: asyncio.Future | None = None  # the latest look at the app's status
        self._deleting_since = 0.0

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

        with own_internal_request_id():
            responses = self.handle.generate.remote(request_id, prompt, params, resume)
        try:
            async for item in responses:
                yield item
        except BackPressureError:
            yield overloaded("the server is overloaded: too many requests are queued; retry later")
        except RayActorError as error:  # the replica's process died (a crash, a lost node)
            if is_stopped_by_serve(error):  # stopped, not crashed: another replica goes on
                yield Handover()
                return
            logger.warning("request %s lost its LLMServer replica: %s", request_id, type(error).__name__)
            yield overloaded("the engine replica serving this request died; retry later")
        finally:
            responses.cancel()  # a client that went away: the replica aborts the request


def _is_app_deleting() -> bool:
    from ray import serve

    try:
        app = serve.status().applications.get(serve.get_replica_context().app_name)
    except Exception:  # the controller did not answer: assume a replica will take the stream
        logger.warning("could not read the application's status", exc_info=True)
        return False
    return app is None or app.status == "DELETING"
