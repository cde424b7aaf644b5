"""The OpenAI-compatible HTTP ingress: a FastAPI app in a Ray Serve deployment that routes each
request to its model's LLMServer.

Every error leaves in OpenAI's shape with the right status (400 bad input or malformed JSON, 401
wrong or missing key, 404 unknown model, 503 overloaded or engine dead); unexpected errors are
logged here and answered with a plain 500, never a traceback.

(No `from __future__ import annotations` here: FastAPI must see the route parameters' real types
through Serve's class-based routing, and string annotations defeat it.)
"""


import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import logging
import os
import time
from typing import Any, AsyncIterator, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.cluster.generation_defaults import GenerationDefaults
from pagedserve.cluster.handover import is_stopped_by_serve
from pagedserve.cluster.llm_server import ErrorInfo, Handover, overloaded
from pagedserve.cluster.openai_serving import APIError, OpenAIServing, RequestLimits
from pagedserve.cluster.prompt_renderer import PromptRenderer
from pagedserve.cluster.serving_options import ServingOptions
from pagedserve.cluster.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse, TokenizeRequest
from pagedserve.config import DEFAULT_MAX_REQUEST_BODY_BYTES, describe_validation_error
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None)
HEALTH_TIMEOUT_S = 10.0
APP_STATUS_MAX_AGE_S = 1.0  # how long one look at the app's status answers whether it is being deleted
MAX_REPORTED_PROBLEMS = 5  # validation problems named in one 400
# Routes that answer without a key: load balancers, Prometheus and schema readers carry none.
OPEN_PATHS = ("/health", "/metrics", "/openapi.json")
_ERRORS = {"model": ErrorResponse, "description": "An error in OpenAI's shape"}
# Documented on every route that takes a body ("4XX" also keeps FastAPI from documenting a 422
# it never sends: validation errors are 400s here, as OpenAI's are).
_BODY_ROUTE_RESPONSES: dict[int | str, dict[str, Any]] = {"4XX": _ERRORS, 503: _ERRORS}
_GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {}, "text/event-stream": {}}, "description": "A body, or a stream of SSE events"},
    **_BODY_ROUTE_RESPONSES,
}


@app.exception_handler(APIError)
async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return _error_response(error)


@app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    return _error_response(_validation_error(error.errors()))


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(error.status_code, "BadRequestError")
    return _error_response(APIError(error.status_code, str(error.detail), kind))


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error serving %s", request.url.path)
    return _error_response(APIError(500, "internal server error", "InternalServerError"))


def _error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _validation_error(items: list[dict[str, Any]]) -> APIError:
    """FastAPI's report on a request body, as the 400 OpenAI would send."""
    first = items[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error", "JSON decode error")
        return APIError(400, f"the request body is not valid JSON: {reason} (at character {first['loc'][-1]})")
    located = [{**item, "loc": tuple(item["loc"])[1:] if item["loc"][:1] == ("body",) else item["loc"]} for item in items]
    if not located[0]["loc"] and first["type"] in ("missing", "model_attributes_type", "model_type", "dict_type"):
        return APIError(400, "the request body must be a JSON object")
    param = ".".join(str(part) for part in located[0]["loc"]) or None
    # A body can hold a million wrong items: name the first few, or the 400 outgrows the request.
    message = describe_validation_error(located[:MAX_REPORTED_PROBLEMS], "field")
    if len(located) > MAX_REPORTED_PROBLEMS:
        message += f"; and {len(located) - MAX_REPORTED_PROBLEMS} more problems"
    return APIError(400, message, param=param)


class RequestGate:
    """ASGI middleware in front of every route: the API key first (so nothing about a request
    is parsed for a caller without one), then the body size, from Content-Length and again
    while a chunked body is read (the body is buffered up to the limit and replayed)."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ingress = serve.get_replica_context().servable_object
        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        try:
            if not scope["path"].endswith(OPEN_PATHS):
                ingress.authorize(headers.get("authorization", ""))
            receive = await _bounded_body(receive, headers, ingress.max_request_body_bytes)
        except APIError as error:
            return await _error_response(error)(scope, receive, send)
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


app.add_middleware(RequestGate)


@contextlib.contextmanager
def _own_internal_request_id() -> Iterator[None]:
    """Serve gives every handle call made while serving one HTTP request that request's internal
    id, and its request router files pending calls by it: of several concurrent calls (a
    completion's prompt list, a resume beside a closing stream) all but one would never be
    routed, and a router's per-call state would mix them up. Each engine call gets its own."""
    from ray.serve import context
    from ray.serve._private.utils import generate_request_id

    current = context._get_serve_request_context()
    token = context._serve_request_context.set(dataclasses.replace(current, _internal_request_id=generate_request_id()))
    try:
        yield
    finally:
        context._serve_request_context.reset(token)


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

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams, resume: Any = None) -> AsyncIterator[Any]:
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError

        with _own_internal_request_id():
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


# Module helpers are defined before the ingress class: Serve serializes the class when the
# application is built, and names defined after it would be missing in the replica.
def _respond(result: dict | AsyncIterator[str]) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return StreamingResponse(result, media_type="text/event-stream")


def _unwrap(value: Any) -> Any:
    if isinstance(value, ErrorInfo):
        raise APIError.from_info(value)
    return value


def _renderer(handle: Any) -> PromptRenderer:
    """Tokenization in the ingress, with the tokenizer of the engine behind `handle`."""

    async def fetch_spec() -> dict[str, Any]:
        return await handle.prompt_spec.remote()

    renderer = PromptRenderer(fetch_spec)
    renderer.start()
    return renderer


def _generation_defaults(handle: Any, setting: str) -> GenerationDefaults:
    """The served model's sampling defaults, from the folder the engine's model resolves to."""

    async def model_folder() -> Any:
        from pagedserve.model_resolver import resolve_checkpoint

        spec = await handle.prompt_spec.remote()
        checkpoint = await asyncio.to_thread(resolve_checkpoint, spec["model"], spec.get("tokenizer"), spec.get("revision"))
        return checkpoint.model_path

    return GenerationDefaults(setting, model_folder)


def key_digest(key: str) -> str:
    """What the ingress is given instead of the key itself (see `OpenAIIngress.authorize`)."""
    return hashlib.sha256(key.encode()).hexdigest()


@serve.ingress(app)
class OpenAIIngress:
    def __init__(
        self,
        servers: dict[str, Any],
        metrics_hub: Any,
        limits: dict[str, RequestLimits] | None = None,
        api_key_sha256: str | None = None,
        max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
        options: dict[str, ServingOptions] | None = None,
    ):
        """`api_key_sha256`: the SHA-256 hex digest of the key clients must send, so the key
        itself never travels in the application's arguments; a key in this replica's own
        PAGEDSERVE_API_KEY (how the Helm chart delivers it) is accepted as well."""
        limits, options = limits or {}, options or {}
        self.servers = servers  # served model name -> LLMServer handle
        self.servings = {}
        for name, handle in servers.items():
            served = options.get(name, ServingOptions())
            defaults = _generation_defaults(handle, served.generation_config)
            self.servings[name] = OpenAIServing(
                name, ServeEngineClient(handle), limits.get(name, RequestLimits()), _renderer(handle), served, defaults
            )
        self.metrics_hub = metrics_hub
        own_key = os.environ.get("PAGEDSERVE_API_KEY")
        digests = [api_key_sha256, key_digest(own_key) if own_key else None]
        self.key_digests = [bytes.fromhex(digest) for digest in digests if digest]
        self.max_request_body_bytes = max_request_body_bytes

    @app.post("/v1/completions", responses=_GENERATE_RESPONSES)
    async def completions(self, body: CompletionRequest) -> Response:
        return _respond(await self._serving(body.model).completions(body))

    @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES)
    async def chat_completions(self, body: ChatCompletionRequest) -> Response:
        return _respond(await self._serving(body.model).chat(body))

    @app.get("/v1/models")
    async def models(self) -> Response:
        cards = await asyncio.gather(*(handle.model_card.remote() for handle in self.servers.values()))
        created = int(time.time())
        data = [{"object": "model", "created": created, "owned_by": "pagedserve", **card} for card in cards]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/tokenize", responses=_BODY_ROUTE_RESPONSES)
    async def tokenize(self, body: TokenizeRequest) -> Response:
        messages = [m.as_template_message() for m in body.messages] if body.messages is not None else None
        tokens = await self._handle(body.model).tokenize.remote(body.prompt, messages, body.add_special_tokens)
        tokens = _unwrap(tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens)})

    @app.post("/detokenize", responses=_BODY_ROUTE_RESPONSES)
    async def detokenize(self, body: DetokenizeRequest) -> Response:
        return JSONResponse({"prompt": _unwrap(await self._handle(body.model).detokenize.remote(body.tokens))})

    @app.get("/health")
    async def health(self) -> Response:
        try:
            checks = [handle.is_healthy.remote() for handle in self.servers.values()]
            healthy = all(await asyncio.wait_for(asyncio.gather(*checks), HEALTH_TIMEOUT_S))
        except Exception as error:  # a replica that cannot even answer is not healthy
            logger.warning("health check failed: %r", error)
            healthy = False
        if not healthy:
            return JSONResponse(APIError(503, "the engine is not running", "ServiceUnavailableError").body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)  # documents text/plain, not JSON
    async def metrics(self) -> Response:
        text = await self.metrics_hub.render.remote()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- helpers ---------------------------------------------------------------------------

    def authorize(self, header: str) -> None:
        """Raise a 401 unless `header` is 'Bearer <key>' for a configured key (RequestGate calls
        this for every route but OPEN_PATHS)."""
        if not self.key_digests:
            return
        scheme, _, token = header.partition(" ")
        given = hashlib.sha256(token.strip().encode()).digest()
        # Constant-time comparison: the time taken must not reveal how much of the key matched.
        matched = any([hmac.compare_digest(given, digest) for digest in self.key_digests])
        if scheme.lower() != "bearer" or not matched:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", "AuthenticationError")

    def _serving(self, model: str) -> OpenAIServing:
        serving = self.servings.get(model)
        if serving is None:
            raise APIError(404, f"model {model!r} does not exist; served: {', '.join(self.servings)}", "NotFoundError", "model")
        return serving

    def _handle(self, model: str | None) -> Any:
        if model is None:
            return next(iter(self.servers.values()))
        self._serving(model)
        return self.servers[model]
