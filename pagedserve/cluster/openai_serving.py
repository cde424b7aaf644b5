"""The completions and chat endpoints' logic, independent of the web framework: map a validated
request onto engine requests, and turn their outputs into OpenAI bodies or SSE events.

The engine is reached through an `EngineClient` (an async generator of `RequestOutput`s, or an
`ErrorInfo` first when the engine refuses the request), so the same code serves a Serve handle and
an in-process AsyncLLM.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from pagedserve.cluster import openai_format as fmt
from pagedserve.cluster.chat_output import ChatOutput
from pagedserve.cluster.generation_defaults import GenerationDefaults
from pagedserve.cluster.stream_items import ErrorInfo, StreamItem
from pagedserve.cluster.stream_merge import merge_streams
from pagedserve.cluster.stream_race import cancel_and_wait
from pagedserve.cluster.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from pagedserve.cluster.serving_options import ServingOptions
from pagedserve.cluster.tool_formats import forced_call_spec
from pagedserve.cluster.tool_requests import template_tools
from pagedserve.engine.engine_core_output import GRAMMAR_ERROR_PREFIX, FinishReason
from pagedserve.engine.input_processor import ResumeState
from pagedserve.engine.request_output import CompletionOutput, RequestOutput
from pagedserve.inputs import ChatPrompt, ServerPrompt, is_chat_prompt
from pagedserve.lora_request import LoRARequest
from pagedserve.request_ids import new_response_id, prompt_request_id
from pagedserve.sampling_params import SamplingParamError, SamplingParams


class APIError(Exception):
    """An error to send in OpenAI's shape: {"error": {"message", "type", "code", "param"}}."""

    def __init__(
        self, status: int, message: str, type: str = "BadRequestError", param: str | None = None, retry_after_s: int | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.retry_after_s = retry_after_s  # sent as the Retry-After header

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.status, "param": self.param}}

    @classmethod
    def from_info(cls, info: ErrorInfo) -> APIError:
        return cls(info.status, info.message, info.type, info.param, info.retry_after_s)


@dataclass(frozen=True)
class RequestLimits:
    """The engine's per-request limits the HTTP layer checks before anything is sent (its
    EngineConfig's max_n and max_logprobs), so a 400 names the OpenAI field."""

    max_n: int = 128
    max_logprobs: int = 20

    def check(self, num_prompts: int, n: int, logprobs: int | None, logprobs_field: str) -> None:
        if num_prompts * n > self.max_n:
            given = f"n={n}" if num_prompts == 1 else f"{num_prompts} prompts x n={n} = {num_prompts * n}"
            raise APIError(400, f"{given} exceeds the limit of max_n={self.max_n} samples per request", param="n")
        if logprobs is not None and logprobs > self.max_logprobs:
            raise APIError(400, f"{logprobs_field}={logprobs} exceeds the limit of max_logprobs={self.max_logprobs}", param=logprobs_field)


class EngineClient(Protocol):
    def generate(
        self, request_id: str, prompt: ServerPrompt, params: SamplingParams, resume: ResumeState | None = None
    ) -> AsyncIterator[StreamItem]: ...


@dataclass
class _Started:
    """One engine request whose first item has arrived (so refusals are known before any reply)."""

    first: RequestOutput
    rest: AsyncIterator[RequestOutput | ErrorInfo]


class PromptRenderer(Protocol):
    async def render(self, prompt: ServerPrompt) -> ServerPrompt: ...


class OpenAIServing:
    def __init__(
        self,
        model_name: str,
        client: EngineClient,
        limits: RequestLimits = RequestLimits(),
        renderer: PromptRenderer | None = None,
        options: ServingOptions = ServingOptions(),
        defaults: GenerationDefaults | None = None,
        lora_request: LoRARequest | None = None,
    ):
        """`client`: the engine (the ingress wraps a deployment's in handover.ResumingClient, so
        streams whose replica leaves go on on another). `renderer`: turns prompts into token ids before they are sent (the Serve ingress, so
        the request router sees tokens); None: the engine tokenizes. `options`: the server's
        tool-call and reasoning parsers; `defaults`: the model's sampling defaults.
        `lora_request`: the adapter `model_name` names (it travels with each prompt)."""
        self.model_name = model_name
        self.lora_request = lora_request
        self.client = client
        self.limits = limits
        self.renderer = renderer
        self.options = options
        self.defaults = defaults

    # ---- endpoints -------------------------------------------------------------------------

    async def completions(self, request: CompletionRequest, tenant_salt: str | None = None) -> dict | AsyncIterator[str]:
        """`tenant_salt`: the caller's prefix-cache salt when the body gives no `cache_salt`."""
        params = _sampling_params(request, request.max_tokens, request.logprobs, await self._defaults())
        response_id = new_response_id("cmpl")
        try:
            prompts = request.prompts()
        except ValueError as error:
            raise APIError(400, str(error), param="prompt") from None
        self.limits.check(len(prompts), request.n, request.logprobs, "logprobs")
        started = await self._start(response_id, prompts, params, request.cache_salt or tenant_salt)
        num_top = request.logprobs or 0

        def choice(index: int, completion: CompletionOutput, first: bool) -> dict:
            return fmt.completion_choice(index, completion, num_top)

        if request.stream:
            return self._events("text_completion", response_id, request, started, choice)
        return await self._final("text_completion", response_id, request, started, choice)

    async def chat(self, request: ChatCompletionRequest, tenant_salt: str | None = None) -> dict | AsyncIterator[str]:
        forced_spec, output = _chat_output(request, self.options)
        params = _sampling_params(request, request.max_output_tokens, request.num_logprobs, await self._defaults(), forced_spec)
        if output.keeps_special_tokens:
            params = params.clone(skip_special_tokens=False)
        response_id = new_response_id("chatcmpl")
        self.limits.check(1, request.n, request.top_logprobs, "top_logprobs")
        messages = [m.as_template_message() for m in request.messages]
        prompt = ChatPrompt(messages=messages, add_generation_prompt=request.add_generation_prompt)
        if request.tools:
            prompt["tools"] = template_tools(request.tools)
        started = await self._start(response_id, [prompt], params, request.cache_salt or tenant_salt)
        num_top = request.top_logprobs or 0
        is_parsed = output.reasoning is not None or output.tools is not None
        if request.stream:
            streams: dict[int, Any] = {}

            def chunk_choice(index: int, completion: CompletionOutput, first: bool) -> dict:
                body = fmt.chat_chunk_choice(index, completion, num_top, first)
                if is_parsed:  # reasoning and tool calls split off the text
                    delta, body["finish_reason"] = streams.setdefault(index, output.stream()).delta(completion.text, completion.finish_reason)
                    body["delta"] = {**({"role": "assistant"} if first else {}), **delta}
                return body

            return self._events("chat.completion.chunk", response_id, request, started, chunk_choice)

        def choice(index: int, completion: CompletionOutput, first: bool) -> dict:
            body = fmt.chat_choice(index, completion, num_top)
            if is_parsed:
                body["message"], body["finish_reason"] = output.message(completion.text, completion.finish_reason)
            return body

        return await self._final("chat.completion", response_id, request, started, choice)

    async def _defaults(self) -> dict[str, Any]:
        return await self.defaults.get() if self.defaults is not None else {}

    # ---- engine requests ---------------------------------------------------------------------

    async def _start(
        self, response_id: str, prompts: list[ServerPrompt], params: SamplingParams, cache_salt: str | None = None
    ) -> list[_Started]:
        """Send every prompt and wait for each first item; a refusal cancels the others."""
        if self.renderer is not None:
            try:  # the renderer encodes off the event loop, after a length check
                prompts = [await self.renderer.render(prompt) for prompt in prompts]
            except ValueError as error:
                param = "messages" if any(is_chat_prompt(p) for p in prompts) else "prompt"
                raise APIError(400, str(error), param=param) from None
        prompts = [_with_adapter(_salted(prompt, cache_salt), self.lora_request) for prompt in prompts]
        streams = [self.client.generate(prompt_request_id(response_id, i), prompt, params) for i, prompt in enumerate(prompts)]
        reads = [asyncio.ensure_future(anext(stream)) for stream in streams]
        try:
            firsts = await asyncio.gather(*reads)
        except BaseException:  # one read's failure leaves the others running: a stream closes only once its read ends
            await asyncio.gather(*(cancel_and_wait(read) for read in reads))
            await _close_all(streams)
            raise
        error = next((item for item in firsts if isinstance(item, ErrorInfo)), None)
        if error is not None:
            await _close_all(streams)
            raise APIError.from_info(error)
        return [_Started(first, stream) for first, stream in zip(firsts, streams)]

    async def _final(self, object_type: str, response_id: str, request: SamplingFields, started: list[_Started], choice: Callable) -> dict:
        """Non-streaming: each request's one output is final (FINAL_ONLY) and holds all n samples."""
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for prompt_index, item in enumerate(started):
            final = item.first
            if any(c.finish_reason == FinishReason.ABORT.value for c in final.outputs):
                raise APIError(503, "the request was aborted: the engine stopped serving it", "ServiceUnavailableError")
            failed = next((c for c in final.outputs if c.finish_reason == FinishReason.ERROR.value), None)
            if failed is not None:
                raise _failed_request_error(request, failed.error)
            prompt_tokens += len(final.prompt_token_ids)
            for completion in final.outputs:
                completion_tokens += len(completion.token_ids)
                choices.append(choice(prompt_index * request.n + completion.index, completion, False))
        body = fmt.envelope(object_type, response_id, self.model_name, choices)
        body["usage"] = fmt.usage(prompt_tokens, completion_tokens)
        return body

    async def _events(
        self, object_type: str, response_id: str, request: SamplingFields, started: list[_Started], choice: Callable
    ) -> AsyncIterator[str]:
        """SSE events. A chunk that finishes a choice carries the usage so far (the last one the
        total); with stream_options.include_usage a final chunk with no choices carries it too."""
        created = int(time.time())
        prompt_tokens = sum(len(item.first.prompt_token_ids) for item in started)
        completion_tokens = 0
        seen: set[int] = set()
        try:
            async for prompt_index, output in _merge(started):
                if isinstance(output, ErrorInfo):
                    yield _event(APIError.from_info(output).body())
                    break
                failed = next((c for c in output.outputs if c.finish_reason == FinishReason.ERROR.value), None)
                if failed is not None:  # the request's own input failed late: an error event ends the stream
                    yield _event(_failed_request_error(request, failed.error).body())
                    break
                for completion in output.outputs:
                    index = prompt_index * request.n + completion.index
                    completion_tokens += len(completion.token_ids)
                    chunk = fmt.envelope(object_type, response_id, self.model_name, [choice(index, completion, index not in seen)], created)
                    seen.add(index)
                    if completion.finish_reason is not None:
                        chunk["usage"] = fmt.usage(prompt_tokens, completion_tokens)
                    yield _event(chunk)
            if request.include_usage:
                chunk = fmt.envelope(object_type, response_id, self.model_name, [], created)
                chunk["usage"] = fmt.usage(prompt_tokens, completion_tokens)
                yield _event(chunk)
            yield "data: [DONE]\n\n"
        finally:
            await _close_all([item.rest for item in started])


async def _merge(started: list[_Started]) -> AsyncIterator[tuple[int, RequestOutput | ErrorInfo]]:
    """Items of several streams as they come, tagged with their stream's index."""
    if len(started) == 1:
        yield 0, started[0].first
        async for item in started[0].rest:
            yield 0, item
        return

    async def whole(item: _Started) -> AsyncIterator[RequestOutput | ErrorInfo]:
        yield item.first
        async for output in item.rest:
            yield output

    async for index, output in merge_streams([whole(item) for item in started]):
        yield index, output


def _salted(prompt: Any, cache_salt: str | None) -> Any:
    """The prompt with its prefix-cache salt (the router and the engine both read it there)."""
    if cache_salt is None:
        return prompt
    return {"prompt": prompt, "cache_salt": cache_salt} if isinstance(prompt, str) else {**prompt, "cache_salt": cache_salt}


def _with_adapter(prompt: Any, lora_request: LoRARequest | None) -> Any:
    """The prompt with the adapter its request's model names, for the replica to take out."""
    if lora_request is None:
        return prompt
    return {"prompt": prompt, "lora_request": lora_request} if isinstance(prompt, str) else {**prompt, "lora_request": lora_request}


def _sampling_params(
    request: SamplingFields, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None = None, forced_spec: dict | None = None
) -> SamplingParams:
    try:
        return request.sampling_params(max_tokens, logprobs, defaults, forced_spec)
    except SamplingParamError as error:
        raise APIError(400, str(error), param=error.field) from None
    except ValueError as error:  # a FieldError (structured outputs, tools, logit_bias) names its field
        raise APIError(400, str(error), param=getattr(error, "param", None)) from None


def _failed_request_error(request: SamplingFields, message: str | None) -> APIError:
    """A 400 for a request whose own input failed once running (engine finish_reason "error"),
    naming the field a failed grammar came from."""
    message = message or "the request failed"
    if not message.startswith(GRAMMAR_ERROR_PREFIX):
        return APIError(400, message)
    if request.response_format is not None and request.response_format.type != "text":
        field = "response_format"
    elif request.structured_outputs is not None and request.structured_outputs.kinds():
        field = "structured_outputs"
    else:
        field = "tools"  # the grammar of a forced tool call
    return APIError(400, message, param=field)


def _chat_output(request: ChatCompletionRequest, options: ServingOptions) -> tuple[dict | None, ChatOutput]:
    """The constraint a forced tool call imposes, and the parsers of the reply (400 on bad tools)."""
    try:
        forced = request.forced_tool_call()
        spec = forced_call_spec(forced, options.tool_call_parser, request.is_compact_json) if forced is not None else None
        return spec, ChatOutput(options, request.effective_tool_choice, bool(request.tools))
    except ValueError as error:
        raise APIError(400, str(error), param=getattr(error, "param", None)) from None


async def _close_all(streams: list[AsyncIterator]) -> None:
    for stream in streams:
        close = getattr(stream, "aclose", None)
        if close is not None:
            try:
                await close()
            except Exception:  # closing a stream that already failed
                pass


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
