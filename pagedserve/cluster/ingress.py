"""The OpenAI-compatible HTTP ingress: a FastAPI app in a Ray Serve deployment that routes each
request to its model's LLMServer.

Every error leaves in OpenAI's shape with the right status (400 bad input or malformed JSON, 401
wrong or missing key, 404 unknown model, 503 overloaded or engine dead); unexpected errors are
logged here and answered with a plain 500, never a traceback.

(No `from __future__ import annotations` here: FastAPI must see the route parameters' real types
through Serve's class-based routing, and string annotations defeat it.)
"""


import asyncio
import hmac
import json
import logging
import os
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve

from pagedserve.cluster.llm_server import ErrorInfo
from pagedserve.cluster.openai_serving import APIError, OpenAIServing
from pagedserve.cluster.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None)
HEALTH_TIMEOUT_S = 10.0


@app.exception_handler(APIError)
async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


@app.exception_handler(Exception)
async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error serving %s", request.url.path)
    return JSONResponse(APIError(500, "internal server error", "InternalServerError").body(), status_code=500)


class ServeEngineClient:
    """The LLMServer deployment as an EngineClient: a streaming handle call per request."""

    def __init__(self, handle: Any):
        self.handle = handle.options(stream=True)

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams) -> AsyncIterator[Any]:
        from ray.serve.exceptions import BackPressureError

        responses = self.handle.generate.remote(request_id, prompt, params)
        try:
            async for item in responses:
                yield item
        except BackPressureError:
            yield ErrorInfo(503, "the server is overloaded: too many requests are queued; retry later", "ServiceUnavailableError")
        finally:
            responses.cancel()  # a client that went away: the replica aborts the request


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


def _describe(item: dict) -> str:
    location = ".".join(str(part) for part in item["loc"])
    message = item["msg"].removeprefix("Value error, ")
    if item["type"] == "extra_forbidden":
        return f"unknown field '{location}'"
    return f"{location}: {message}" if location else message


@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, servers: dict[str, Any], metrics_hub: Any, api_key: str | None = None):
        self.servers = servers  # served model name -> LLMServer handle
        self.servings = {name: OpenAIServing(name, ServeEngineClient(handle)) for name, handle in servers.items()}
        self.metrics_hub = metrics_hub
        self.api_key = api_key or os.environ.get("PAGEDSERVE_API_KEY") or None

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        body = await self._validated(request, CompletionRequest)
        return _respond(await self._serving(body.model).completions(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        body = await self._validated(request, ChatCompletionRequest)
        return _respond(await self._serving(body.model).chat(body))

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        cards = await asyncio.gather(*(handle.model_card.remote() for handle in self.servers.values()))
        created = int(time.time())
        data = [{"object": "model", "created": created, "owned_by": "pagedserve", **card} for card in cards]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        body = await self._validated(request, TokenizeRequest)
        messages = [m.as_template_message() for m in body.messages] if body.messages is not None else None
        tokens = await self._handle(body.model).tokenize.remote(body.prompt, messages, body.add_special_tokens)
        tokens = _unwrap(tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens)})

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        body = await self._validated(request, DetokenizeRequest)
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

    @app.get("/metrics")
    async def metrics(self) -> Response:
        text = await self.metrics_hub.render.remote()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- helpers ---------------------------------------------------------------------------

    async def _validated(self, request: Request, model: type[BaseModel]) -> Any:
        """Authorize, then parse and validate the JSON body (malformed or invalid: 400)."""
        self._authorize(request)
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise APIError(400, f"the request body is not valid JSON: {error}") from None
        if not isinstance(data, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            return model.model_validate(data)
        except ValidationError as error:
            first = error.errors()[0]
            param = ".".join(str(part) for part in first["loc"]) or None
            messages = "; ".join(_describe(item) for item in error.errors())
            raise APIError(400, messages, param=param) from None

    def _authorize(self, request: Request) -> None:
        """Every route but /health and /metrics calls this (load balancers and Prometheus carry
        no key)."""
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # Constant-time comparison: the time taken must not reveal how much of the key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.api_key.encode()):
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
