"""The ASGI gate in front of every route of the HTTP ingress: a stopping server's refusal, the
API key, then the body's size."""

from __future__ import annotations

from typing import Any

from ray import serve

from pagedserve.cluster.http_errors import error_response
from pagedserve.cluster.openai_serving import APIError

# Routes that answer without a key: load balancers, Prometheus and schema readers carry none.
OPEN_PATHS = ("/health", "/metrics", "/openapi.json")


# What a stopping server answers to every new request, /health included (so a load balancer
# stops sending): its streams finish, and nothing new starts that the stop would cut.
STOPPING = APIError(503, "the server is shutting down", "ServiceUnavailableError")


class RequestGate:
    """ASGI middleware in front of every route: a 503 once the ingress is stopping
    (`OpenAIIngress.stop_taking_requests`), the API key (so nothing about a request is parsed
    for a caller without one), then the body size, from Content-Length and again while a
    chunked body is read (the body is buffered up to the limit and replayed)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ingress = serve.get_replica_context().servable_object
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        try:
            if ingress.stopping:
                raise STOPPING
            ingress.authorize_path(scope["path"], headers.get("authorization", ""))
            receive = await _bounded_body(receive, headers, ingress.max_request_body_bytes)
        except APIError as error:
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


async def _bounded_body(receive: Any, headers: dict[str, str], limit: int) -> Any:
    """Read the whole body (at most `limit` bytes, else a 413) and return a `receive` that
    replays it, then hands over to the real one (which reports the client's disconnect)."""
    too_large = APIError(413, f"the request body exceeds max_request_body_bytes={limit}", "RequestTooLargeError")
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away mid-body: pass that on
            first = message
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > limit:
            raise too_large
        if not message.get("more_body", False):
            first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            break
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return first
        return await receive()

    return replay
