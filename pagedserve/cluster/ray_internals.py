"""Everything pagedserve takes from Ray that Ray does not promise, behind one fence: Serve's
private modules and attributes, and the text and code of Ray's own handlers and errors. Each was
read from Ray 2.60 and is tested there (tests/cluster/test_ray_internals.py, the drain tests); a
Ray these were not checked against stops the server at import, with a clear error, rather than
failing in a replica at the first drain (set PAGEDSERVE_ALLOW_UNTESTED_RAY=1 to try one anyway).

What is here, and who uses it:
- `PowerOfTwoChoicesRequestRouter`: Serve's default router, not public; the routers subclass it
  (handover_router.py, prefix_router.py).
- `own_internal_request_id`: sets Serve's private request context (serve_engine_client.py).
- `is_stopped_by_serve`: reads the text of the actor error `ray.kill` leaves (serve_engine_client.py).
- `actor_death`: the GCS's record of why an actor died, from Ray's private state API (the same
  question over Serve's gRPC transport, where the error says only "unavailable").
- `SigtermHook`: replaces the exit function Ray's SIGTERM handler looks up in its module's
  globals (llm_server.py; the why is in replica_drain.py's note).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
from typing import Callable, Iterator

import ray

TESTED_RAY_VERSIONS = ("2.60",)  # major.minor releases these internals were read from and tested on
ALLOW_UNTESTED_RAY_ENV = "PAGEDSERVE_ALLOW_UNTESTED_RAY"

logger = logging.getLogger("ray.serve")  # into the replica's log, beside Serve's own news


class UntestedRayError(RuntimeError):
    """The installed Ray is not one whose internals this module was checked against."""


def check_ray_version(version: str, allow_untested: bool = False) -> None:
    """Raise UntestedRayError unless `version` is a release of a tested major.minor."""
    major_minor = ".".join(version.split(".")[:2])
    if major_minor in TESTED_RAY_VERSIONS:
        return
    message = (
        f"pagedserve's cluster code relies on Ray Serve internals checked only on Ray {', '.join(TESTED_RAY_VERSIONS)}.x, "
        f"and Ray {version} is installed: install ray[serve]=={TESTED_RAY_VERSIONS[-1]}.* "
        f"(or set {ALLOW_UNTESTED_RAY_ENV}=1 to try this one; pagedserve/cluster/ray_internals.py lists what to check)"
    )
    if not allow_untested:
        raise UntestedRayError(message)
    logger.warning("%s; going on as %s is set", message, ALLOW_UNTESTED_RAY_ENV)


check_ray_version(ray.__version__, os.environ.get(ALLOW_UNTESTED_RAY_ENV) == "1")

# Imported only once the version is known (on another Ray these may not even exist).
from ray.serve import context as serve_context  # noqa: E402
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # noqa: E402, F401
from ray.serve._private.utils import generate_request_id  # noqa: E402

RAY_EXIT_FUNCTION = "raise_sys_exit_with_custom_error_message"  # what Ray's SIGTERM handler calls
RAY_SIGTERM_MESSAGE = "The process receives a SIGTERM."
RAY_KILL_ERROR_TEXT = "killed by `ray.kill`"  # in an actor error's text when its actor was ended by `ray.kill`


@contextlib.contextmanager
def own_internal_request_id() -> Iterator[None]:
    """Serve gives every handle call made while serving one HTTP request that request's internal
    id, and its request router files pending calls by it: of several concurrent calls (a
    completion's prompt list, a resume beside a closing stream) all but one would never be
    routed, and a router's per-call state would mix them up. Each engine call gets its own."""
    current = serve_context._get_serve_request_context()
    token = serve_context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=generate_request_id()))
    try:
        yield
    finally:
        serve_context._serve_request_context.reset(token)


def is_stopped_by_serve(error: BaseException) -> bool:
    """A replica's actor error because Serve's controller ended it (`ray.kill` after the
    graceful-shutdown period), as opposed to a crash (a killed process, a lost node)."""
    return RAY_KILL_ERROR_TEXT in str(error)


def actor_death(actor_id: str) -> str | None:
    """Why the actor `actor_id` (hex) is not serving, as the GCS records it: the reason's name
    (`RAY_KILL`, `WORKER_DIED`, `NODE_DIED`, ...) once it is dead, `RESTARTING` while Ray restarts
    it, None while the GCS still holds it alive (or does not know it). A blocking GCS call."""
    from ray._private import state
    from ray.core.generated import common_pb2

    info = state.actors(actor_id=actor_id)
    if not info or info.get("State") not in ("DEAD", "RESTARTING"):
        return None
    if info["State"] == "RESTARTING":
        return "RESTARTING"
    cause = info["DeathCause"]
    if cause.WhichOneof("context") != "actor_died_error_context":
        return cause.WhichOneof("context") or "UNSPECIFIED"
    return common_pb2.ActorDiedErrorContext.Reason.Name(cause.actor_died_error_context.reason)


class SigtermHook:
    """Turns SIGTERM in a Ray worker into a call of `on_sigterm` (see replica_drain.py's note).
    `on_sigterm` runs on the main thread, inside the signal handler: it must only hand the news
    over (thread-safe) and return True, or return False to let Ray exit as it would have."""

    def __init__(self, on_sigterm: Callable[[], bool]):
        self.on_sigterm = on_sigterm

    def install(self) -> bool:
        """True once SIGTERM reaches `on_sigterm`; False (logged) where Ray's handler is not the
        one this hook knows, and SIGTERM stays Ray's."""
        handler = signal.getsignal(signal.SIGTERM)
        code = getattr(handler, "__code__", None)
        if code is None or RAY_EXIT_FUNCTION not in code.co_names or RAY_SIGTERM_MESSAGE not in code.co_consts:
            logger.warning("SIGTERM's handler is not Ray 2.60's worker handler (%r): a SIGTERM stops this replica without a drain", handler)
            return False
        namespace = handler.__globals__
        ray_exit = namespace[RAY_EXIT_FUNCTION]

        def exit_or_drain(message: str, exit_code: int = 0) -> None:
            if message == RAY_SIGTERM_MESSAGE and self.on_sigterm():
                return  # the drain began; the actor ends when it is done (`end_actor`)
            ray_exit(message, exit_code)

        namespace[RAY_EXIT_FUNCTION] = exit_or_drain
        return True
