"""The two ways `serving.py` sends a request: over HTTP to any OpenAI-compatible server, or
straight into an in-process `AsyncLLM`. Both stream, time every chunk the same way and return a
`RequestResult`, so the difference between them is the serving path and nothing else.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from serving_metrics import RequestResult


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload; the same list goes to every backend."""

    prompt: str | list[int]  # text, or token ids (the OpenAI API takes both)
    prompt_len: int  # tokens asked for; exact for ids, approximate for text
    output_len: int  # max_tokens, and with ignore_eos also the exact output length
    model: str | None = None  # the served model (a LoRA adapter's name) for this request; None: the run's


class HttpBackend:
    """Streams `POST /v1/completions` with aiohttp; one session (connection pool) per run."""

    name = "http"

    def __init__(self, base_url: str, model: str | None, api_key: str | None, temperature: float, timeout_s: float, max_connections: int | None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.temperature = temperature
        self.timeout_s = timeout_s
        # aiohttp caps a session at 100 connections by default: with more requests in flight the
        # rest would wait in the client and their queueing would be counted as server TTFT.
        self.max_connections = max_connections or 0
        self.session: Any = None

    async def __aenter__(self) -> HttpBackend:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=self.max_connections)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self.headers)
        if self.model is None:
            self.model = await self._first_model()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.session.close()

    async def _first_model(self) -> str:
        """The server's first model, so `--model` can be left out against a one-model server."""
        async with self.session.get(f"{self.base_url}/v1/models") as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]

    def payload(self, spec: RequestSpec) -> dict:
        return {
            "model": spec.model or self.model,
            "prompt": spec.prompt,
            "max_tokens": spec.output_len,
            "temperature": self.temperature,
            "ignore_eos": True,  # vLLM's extra: the output length is what was asked, not the model's choice
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(self, spec: RequestSpec, request_id: str) -> RequestResult:
        result = RequestResult(prompt_len=spec.prompt_len, expected_output_len=spec.output_len)
        start = time.perf_counter()
        try:
            url = f"{self.base_url}/v1/completions"
            async with self.session.post(url, json=self.payload(spec), headers={"X-Request-Id": request_id}) as response:
                if response.status != 200:
                    result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                    return result
                await self._read_stream(response, result, start)
        except Exception as error:  # a failed request is a data point, not the end of the run
            result.error = f"{type(error).__name__}: {error}"[:200]
        return result

    async def _read_stream(self, response: Any, result: RequestResult, start: float) -> None:
        timer = ChunkTimer(start)
        async for raw_line in response.content:
            line = raw_line.strip()
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, keep-alives
            data = line[len(b"data:"):].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = str(chunk["error"])[:200]
                return
            if chunk.get("choices"):
                timer.tick(result)
            usage = chunk.get("usage")
            if usage:
                result.output_tokens = usage.get("completion_tokens", 0)
                result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
        result.e2el = time.perf_counter() - start
        # Without usage, assume one token per chunk (true of vLLM-style servers at n=1).
        result.output_tokens = result.output_tokens or timer.num_chunks
        result.is_success = timer.num_chunks > 0
        if not result.is_success:
            result.error = "the stream ended before any content"


class InProcessBackend:
    """`AsyncLLM` in this process: the engine without HTTP, Serve or SSE, as the baseline."""

    name = "inprocess"

    def __init__(self, model_path: str, engine_args: dict, temperature: float):
        self.model_path = model_path
        self.engine_args = engine_args
        self.temperature = temperature
        self.llm: Any = None

    async def __aenter__(self) -> InProcessBackend:
        from pagedserve.engine.async_llm import AsyncLLM

        # Built inside the event loop on purpose: nothing else runs yet, and AsyncLLM binds each
        # request to the loop that calls generate(), not to the one that built it.
        self.llm = AsyncLLM.from_engine_args(model=self.model_path, **self.engine_args)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.llm.shutdown()

    async def send(self, spec: RequestSpec, request_id: str) -> RequestResult:
        from pagedserve.sampling_params import RequestOutputKind, SamplingParams

        result = RequestResult(prompt_len=spec.prompt_len, expected_output_len=spec.output_len)
        params = SamplingParams(
            temperature=self.temperature,
            max_tokens=spec.output_len,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,  # one output per engine step, as SSE chunks are
        )
        prompt = spec.prompt if isinstance(spec.prompt, str) else {"prompt_token_ids": spec.prompt}
        start = time.perf_counter()
        timer = ChunkTimer(start)
        finish_reason = None
        try:
            async for output in self.llm.generate(prompt, params, request_id):
                completion = output.outputs[0]
                if completion.token_ids:
                    timer.tick(result)
                    result.output_tokens += len(completion.token_ids)
                result.prompt_len = len(output.prompt_token_ids)
                finish_reason = completion.finish_reason
        except Exception as error:
            result.error = f"{type(error).__name__}: {error}"[:200]
            return result
        result.e2el = time.perf_counter() - start
        result.is_success = timer.num_chunks > 0 and finish_reason not in (None, "abort")
        if not result.is_success:
            result.error = f"finished with {finish_reason!r} after {timer.num_chunks} outputs"
        return result


class ChunkTimer:
    """Turns the arrival times of content chunks into TTFT and inter-token gaps."""

    def __init__(self, start: float):
        self.start = start
        self.last = start
        self.num_chunks = 0

    def tick(self, result: RequestResult) -> None:
        now = time.perf_counter()
        if self.num_chunks == 0:
            result.ttft = now - self.start
        else:
            result.itl.append(now - self.last)
        self.last = now
        self.num_chunks += 1
