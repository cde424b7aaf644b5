"""The OpenAI-compatible HTTP ingress: a FastAPI app in a Ray Serve deployment that routes each
request to its model's LLMServer. Errors leave in OpenAI's shape (http_errors.py); the API key
and the body's size are checked before any route (request_gate.py); each engine request is a
streaming call of the LLMServer's handle (serve_engine_client.py).

(No `from __future__ import annotations` here: FastAPI must see the route parameters' real types
through Serve's class-based routing, and string annotations defeat it.)
"""

import asyncio
import hashlib
import hmac
import logging
import os
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from pagedserve.cluster.cached_result import CachedResult
from pagedserve.cluster.generation_defaults import GenerationDefaults
from pagedserve.cluster.handover import ResumingClient
from pagedserve.cluster.http_errors import add_error_handlers
from pagedserve.cluster.local_engine import LocalEngineClient, LocalHub, LocalServer
from pagedserve.cluster.lora_adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, allowed_adapter_path
from pagedserve.cluster.metrics_hub import MetricsHub
from pagedserve.cluster.openai_serving import APIError, OpenAIServing, RequestLimits
from pagedserve.cluster.prompt_renderer import PromptRenderer
from pagedserve.cluster.serving_options import ServingOptions
from pagedserve.cluster.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ErrorResponse, TokenizeRequest
from pagedserve.cluster.request_gate import OPEN_PATHS, RequestGate
from pagedserve.cluster.serve_engine_client import ServeEngineClient
from pagedserve.cluster.server_config import DEFAULT_MAX_REQUEST_BODY_BYTES
from pagedserve.cluster.stream_items import ErrorInfo
from pagedserve.lora_request import LoRARequest

logger = logging.getLogger(__name__)

app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None)
HEALTH_TIMEOUT_S = 10.0
METRICS_TIMEOUT_S = 5.0  # a dead or wedged metrics hub: /metrics answers 503 after this
# /health and /metrics answer from one call's result for this long: a burst of probes is one
# call to each replica (or to the hub) a second, not one per probe.
PROBE_MAX_AGE_S = 1.0
_ERRORS = {"model": ErrorResponse, "description": "An error in OpenAI's shape"}
# Documented on every route that takes a body ("4XX" also keeps FastAPI from documenting a 422
# it never sends: validation errors are 400s here, as OpenAI's are).
_BODY_ROUTE_RESPONSES: dict[int | str, dict[str, Any]] = {"4XX": _ERRORS, 503: _ERRORS}
_GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/json": {}, "text/event-stream": {}}, "description": "A body, or a stream of SSE events"},
    **_BODY_ROUTE_RESPONSES,
}
add_error_handlers(app)
app.add_middleware(RequestGate)


# Module helpers are defined before the ingress class: Serve serializes the class when the
# application is built, and names defined after it would be missing in the replica.
def _respond(result: dict | AsyncIterator[str]) -> Response:
    if isinstance(result, dict):
        return JSONResponse(result)
    return ClosingStreamingResponse(result, media_type="text/event-stream")


class ClosingStreamingResponse(StreamingResponse):
    """Closes its events' generator however the response ends. Closing it closes the engine
    streams beneath it, which aborts their requests. A client that goes away while a chunk is
    being sent ends the response with the generator suspended at its `yield`, not cancelled
    inside it, and then only the garbage collector would close it: the request could decode to
    its end for no one."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                try:
                    await asyncio.shield(close())
                except Exception:  # a generator that failed ends closed already
                    logger.debug("closing a response's events failed", exc_info=True)


def _unwrap(value: Any) -> Any:
    if isinstance(value, ErrorInfo):
        raise APIError.from_info(value)
    return value


def _renderer(handle: Any) -> PromptRenderer:
    """Tokenization in the ingress, with the tokenizer of the engine behind `handle` (an engine in
    this process lends its own, loaded once, and its thread)."""

    async def fetch_spec() -> dict[str, Any]:
        return await handle.prompt_spec.remote()

    renderer = PromptRenderer(fetch_spec, handle.server.tokenizer if isinstance(handle, LocalServer) else None)
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


def _local_servers(config: Any, worker_bundle_indices: tuple[int, ...], metrics_hub: Any) -> dict[str, LocalServer]:
    """The engine built in this process (`engine_host: ingress`). No SIGTERM drain: no other
    replica could take its streams; Serve's graceful shutdown of this replica lets them end."""
    from pagedserve.cluster.llm_server import LLMServer  # torch and the engine: only where they run

    server = LLMServer(config, metrics_hub, worker_bundle_indices, drains_on_sigterm=False)
    return {config.model_name: LocalServer(server)}


def _engine_client(handle: Any, options: ServingOptions) -> Any:
    """The EngineClient for `handle`: a deployment's streams go on on another replica when
    theirs leaves (a downscale, a redeploy, a drain); an engine in this process never leaves."""
    if isinstance(handle, LocalServer):
        return LocalEngineClient(handle)
    return ResumingClient(ServeEngineClient(handle, options.engine_transport))


def key_digest(key: str) -> str:
    """What the ingress is given instead of the key itself (see `OpenAIIngress.authorize`)."""
    return hashlib.sha256(key.encode()).hexdigest()


def api_key_salt(authorization: str) -> str:
    """The prefix-cache salt of the key in an 'Authorization: Bearer <key>' header: a digest of
    its own, so the salt (which travels to the replicas) is not the digest the ingress checks."""
    _, _, token = authorization.partition(" ")
    return "api-key:" + hashlib.sha256(b"pagedserve cache salt\0" + token.strip().encode()).hexdigest()


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
        metrics_require_api_key: bool = False,
        adapters: dict[str, tuple[str, LoRARequest]] | None = None,
        lora_dirs: list[str] | None = None,
        local_engine: tuple[Any, tuple[int, ...]] | None = None,
    ):
        """`api_key_sha256`: the SHA-256 hex digest of the key clients must send, so the key
        itself never travels in the application's arguments; a key in this replica's own
        PAGEDSERVE_API_KEY (how the Helm chart delivers it) is accepted as well.
        `options`: each served model's OpenAI front-end settings (tool and reasoning parsers).
        `metrics_require_api_key`: /metrics needs the key too. `adapters`: LoRA adapters served
        by name -> (the served model they adapt, the adapter); `lora_dirs`: where
        /v1/load_lora_adapter may load more from (lora_adapters.py). `local_engine`: the
        (ServerConfig, worker bundle indices) of an engine to run in this process instead of
        `servers` (`engine_host: ingress`, local_engine.py)."""
        limits, options = limits or {}, options or {}
        if local_engine is not None:
            metrics_hub = LocalHub(MetricsHub()) if metrics_hub is None else metrics_hub
            servers = {**servers, **_local_servers(*local_engine, metrics_hub)}
        self.servers = servers  # served model name -> LLMServer handle (or LocalServer)
        self.servings = {}
        for name, handle in servers.items():
            served = options.get(name, ServingOptions())
            defaults = _generation_defaults(handle, served.generation_config)
            self.servings[name] = OpenAIServing(
                name, _engine_client(handle, served), limits.get(name, RequestLimits()), _renderer(handle), served, defaults
            )
        self.adapters: dict[str, tuple[str, LoRARequest]] = {}
        self.lora_dirs = list(lora_dirs or [])
        self.next_lora_id = 1 + max((lora.lora_int_id for _, lora in (adapters or {}).values()), default=0)
        for name, (base, lora_request) in (adapters or {}).items():
            self._add_adapter(name, base, lora_request)
        self.metrics_hub = metrics_hub
        own_key = os.environ.get("PAGEDSERVE_API_KEY")
        digests = [api_key_sha256, key_digest(own_key) if own_key else None]
        self.key_digests = [bytes.fromhex(digest) for digest in digests if digest]
        self.max_request_body_bytes = max_request_body_bytes
        self.open_paths = tuple(p for p in OPEN_PATHS if not (metrics_require_api_key and p == "/metrics"))
        self.health_probe = CachedResult(self._all_healthy, PROBE_MAX_AGE_S, HEALTH_TIMEOUT_S)
        self.metrics_text = CachedResult(self._render_metrics, PROBE_MAX_AGE_S, METRICS_TIMEOUT_S)
        self.stopping = False

    @app.post("/v1/completions", responses=_GENERATE_RESPONSES)
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        return _respond(await self._serving(body.model).completions(body, self.tenant_salt(request)))

    @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        return _respond(await self._serving(body.model).chat(body, self.tenant_salt(request)))

    @app.get("/v1/models")
    async def models(self) -> Response:
        cards = await asyncio.gather(*(handle.model_card.remote() for handle in self.servers.values()))
        created = int(time.time())
        data = [{"object": "model", "created": created, "owned_by": "pagedserve", **card} for card in cards]
        data += [  # vLLM's shape: an adapter's root is its folder, its parent the model it adapts
            {"id": name, "object": "model", "created": created, "owned_by": "pagedserve", "root": lora.lora_path, "parent": base}
            for name, (base, lora) in self.adapters.items()
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/load_lora_adapter", responses=_BODY_ROUTE_RESPONSES)
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> Response:
        if body.lora_name in self.servings:
            raise APIError(400, f"the name {body.lora_name!r} is already served", param="lora_name")
        try:
            path = allowed_adapter_path(body.lora_path, self.lora_dirs)
        except ValueError as error:
            raise APIError(400, str(error), param="lora_path") from None
        base = next(iter(self.servers))
        # Never reused, by this ingress or one restarted: replicas may still bind an old
        # adapter's id to its folder. The hub hands them out (metrics_hub.py).
        try:
            lora_id = await asyncio.wait_for(self.metrics_hub.new_lora_id.remote(self.next_lora_id), METRICS_TIMEOUT_S)
        except Exception as error:
            raise APIError(503, f"the metrics hub, which hands out adapter ids, did not answer: {error!r}", "ServiceUnavailableError") from None
        self.next_lora_id = lora_id + 1
        lora_request = LoRARequest(body.lora_name, lora_id, path)
        _unwrap(await self.servers[base].check_lora.remote(lora_request))
        if body.lora_name in self.servings:  # loaded meanwhile by a concurrent call
            raise APIError(400, f"the name {body.lora_name!r} is already served", param="lora_name")
        self._add_adapter(body.lora_name, base, lora_request)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", responses=_BODY_ROUTE_RESPONSES)
    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> Response:
        adapter = self.adapters.pop(body.lora_name, None)
        if adapter is None:
            raise APIError(404, f"no LoRA adapter named {body.lora_name!r} is loaded", "NotFoundError", "lora_name")
        del self.servings[body.lora_name]
        base, lora_request = adapter
        try:  # every replica hears of it in its next stats report, and drops the weights
            await asyncio.wait_for(self.metrics_hub.retire_lora.remote(base, lora_request.lora_int_id), METRICS_TIMEOUT_S)
        except Exception as error:  # the name is gone all the same; replicas evict the weights as others need room
            logger.warning("could not tell the replicas that LoRA adapter %r is unloaded: %r", body.lora_name, error)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

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
            healthy = await self.health_probe.get()
        except Exception as error:  # a replica that cannot even answer is not healthy
            logger.warning("health check failed: %r", error)
            healthy = False
        if not healthy:
            return JSONResponse(APIError(503, "the engine is not running", "ServiceUnavailableError").body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse)  # documents text/plain, not JSON
    async def metrics(self) -> Response:
        try:
            text = await self.metrics_text.get()
        except Exception as error:  # the hub is dead, restarting or wedged
            logger.warning("metrics hub did not answer: %r", error)
            body = APIError(503, f"the metrics hub did not answer within {self.metrics_text.timeout_s:g} s", "ServiceUnavailableError").body()
            return JSONResponse(body, status_code=503)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def stop_taking_requests(self) -> None:
        """From now on every new request gets a 503 (RequestGate); those in flight go on. Where
        the replica answers HTTP itself (direct ingress) nothing else refuses them while Serve
        drains it: without this, requests kept arriving, each waited for an engine replica that
        was gone, and the drain never ended (`pagedserve serve` under load, cluster/launcher.py)."""
        self.stopping = True

    def check_health(self) -> None:
        """Serve's health check of this replica: where it holds the engine, a dead engine gets
        it replaced (an LLMServer replica's own check, otherwise)."""
        for server in self.servers.values():
            if isinstance(server, LocalServer):
                server.check_health()

    # ---- helpers ---------------------------------------------------------------------------

    def authorize_path(self, path: str, header: str) -> None:
        """Raise a 401 unless `path` is open (OPEN_PATHS; /metrics only without
        `metrics_require_api_key`) or `header` carries a configured key."""
        if not path.endswith(self.open_paths):
            self.authorize(header)

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

    async def _all_healthy(self) -> bool:
        checks = [handle.is_healthy.remote() for handle in self.servers.values()]
        return all(await asyncio.gather(*checks))

    async def _render_metrics(self) -> str:
        return await self.metrics_hub.render.remote()

    def tenant_salt(self, request: Request) -> str | None:
        """With API keys in use, the prefix-cache salt of the key the caller sent (a request's own
        `cache_salt` wins): each key's prompts hit only its own cached blocks, so the time to
        first token tells no tenant what another sent. Derived apart from the key's digest."""
        return api_key_salt(request.headers.get("authorization", "")) if self.key_digests else None

    def _add_adapter(self, name: str, base: str, lora_request: LoRARequest) -> None:
        """Serve `name`: the base model's front end, with the adapter beside each prompt."""
        base_serving = self.servings[base]
        self.servings[name] = OpenAIServing(
            name, _engine_client(self.servers[base], base_serving.options), base_serving.limits, base_serving.renderer, base_serving.options,
            base_serving.defaults, lora_request,
        )
        self.adapters[name] = (base, lora_request)

    def _serving(self, model: str) -> OpenAIServing:
        serving = self.servings.get(model)
        if serving is None:
            raise APIError(404, f"model {model!r} does not exist; served: {', '.join(self.servings)}", "NotFoundError", "model")
        return serving

    def _handle(self, model: str | None) -> Any:
        if model is None:
            return next(iter(self.servers.values()))
        self._serving(model)
        return self.servers[self.adapters[model][0] if model in self.adapters else model]
