"""What an engine stream carries from an LLMServer replica to the ingress: one typed union.

A stream yields `RequestOutput`s; the engine's refusal of a request comes as an `ErrorInfo` item
(the ingress answers with its status before any reply starts); a replica that stops serving the
stream ends it with a `Handover` (the ingress goes on with the request elsewhere, handover.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from pagedserve.engine.request_output import RequestOutput

RETRY_AFTER_S = 1  # what an overloaded server tells clients (the Retry-After header)


@dataclass
class ErrorInfo:
    """A request the engine refused: the ingress maps it onto OpenAI's error shape."""

    status: int
    message: str
    type: str = "BadRequestError"
    param: str | None = None
    retry_after_s: int | None = None  # an overload: the client may retry after this long


@dataclass(frozen=True)
class Handover:
    """A stream's last item when its replica stopped serving it (Serve stopped the replica, or
    it drains after SIGTERM; then also its answer to a new request): the ingress goes on with the
    request on another replica (cluster/handover.py)."""

    replica_id: str | None = None  # the replica that stopped, when known


def overloaded(message: str) -> ErrorInfo:
    return ErrorInfo(503, message, "ServiceUnavailableError", retry_after_s=RETRY_AFTER_S)


StreamItem = Union[RequestOutput, ErrorInfo, Handover]
