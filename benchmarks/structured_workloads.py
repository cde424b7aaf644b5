"""The requests `structured_outputs.py` sends, the streaming chat client that times them, and the
check of every constrained output (JSON parsed and validated against its schema or tool)."""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

from serving_backends import ChunkTimer
from serving_metrics import RequestResult

WORKLOADS = ("json", "json_free", "tools")


def _text(max_length: int) -> dict:
    return {"type": "string", "maxLength": max_length}


def _closed(properties: dict) -> dict:
    """An object schema as OpenAI's strict mode wants it: every field required, nothing else."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# Bounded strings and arrays, so every answer fits in max_tokens however the model rambles.
SCHEMAS = {
    "person": _closed({"name": _text(32), "age": {"type": "integer", "minimum": 0, "maximum": 120}, "email": _text(40),
                       "hobbies": {"type": "array", "items": _text(20), "maxItems": 3}}),
    "product": _closed({"title": _text(40), "price": {"type": "number"}, "in_stock": {"type": "boolean"},
                        "category": {"enum": ["books", "garden", "kitchen", "toys"]}}),
    "event": _closed({"title": _text(40), "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                      "city": _text(30), "attendees": {"type": "integer", "minimum": 1, "maximum": 10000}}),
    "review": _closed({"rating": {"type": "integer", "minimum": 1, "maximum": 5}, "summary": _text(60),
                       "pros": {"type": "array", "items": _text(24), "maxItems": 3}}),
}

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": _closed({"city": _text(30), "unit": {"enum": ["celsius", "fahrenheit"]}})}},
    {"type": "function", "function": {"name": "search_web", "description": "Search the web",
                                      "parameters": _closed({"query": _text(60), "max_results": {"type": "integer", "minimum": 1, "maximum": 10}})}},
    {"type": "function", "function": {"name": "book_table", "description": "Book a restaurant table",
                                      "parameters": _closed({"restaurant": _text(40), "people": {"type": "integer", "minimum": 1, "maximum": 20}})}},
]
TOOL_PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

CITIES = "Paris Lima Osaka Cairo Oslo Quito Perth Dakar Hanoi Riga Bern Accra".split()
THINGS = "librarian gardener chef pilot teacher sailor baker painter".split()
TOOL_ASKS = ("What is the weather in {city} right now?", "Find me news about {thing}s in {city}.",
             "Book a table for {n} people at a restaurant in {city}.")


@dataclass
class ChatRequest:
    body: dict
    spec_key: str  # which schema (or "tools"): requests sharing it share one compiled grammar
    expected_len: int


@dataclass
class ChatResult:
    timing: RequestResult
    content: str = ""
    tool_calls: dict[int, dict] = field(default_factory=dict)  # index -> {"name", "arguments"}
    finish_reason: str | None = None


def build_requests(workload: str, count: int, max_tokens: int, seed: int, lengths: list[int] | None = None) -> list[ChatRequest]:
    """`json_free` gets `json`'s prompts (same seed) with a different first word, so its prompts
    are new to the prefix cache, and `lengths` as exact output lengths."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        city, thing, n = rng.choice(CITIES), rng.choice(THINGS), rng.randint(2, 9)
        if workload == "tools":
            ask = rng.choice(TOOL_ASKS).format(city=city, thing=thing, n=n)
            body = {"messages": [{"role": "user", "content": ask}], "tools": TOOLS, "tool_choice": "required"}
            requests.append(ChatRequest(body | {"max_tokens": max_tokens}, "tools", max_tokens))
            continue
        name = list(SCHEMAS)[i % len(SCHEMAS)]
        opener = "Answer" if workload == "json" else "Reply"
        system = f"{opener} in JSON only. Request {i}."
        ask = f"Make up a {name} record about a {thing} from {city}."
        body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": ask}]}
        if workload == "json":
            schema = {"name": name, "schema": SCHEMAS[name], "strict": True}
            requests.append(ChatRequest(body | {"max_tokens": max_tokens, "response_format": {"type": "json_schema", "json_schema": schema}}, name, max_tokens))
        else:
            length = max(1, lengths[i]) if lengths else max_tokens
            requests.append(ChatRequest(body | {"max_tokens": length, "ignore_eos": True}, name, length))
    return requests


async def send_chat(session: Any, base_url: str, model: str, request: ChatRequest) -> ChatResult:
    """Streams one chat completion; content, reasoning and tool-call deltas each count as a chunk."""
    body = request.body | {"model": model, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    result = ChatResult(RequestResult(prompt_len=0, expected_output_len=request.expected_len))
    start = time.perf_counter()
    timer = ChunkTimer(start)
    try:
        async with session.post(f"{base_url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                result.timing.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data:") or line == b"data: [DONE]":
                    continue
                _take_chunk(json.loads(line[5:]), result, timer)
    except Exception as error:  # a failed request is a data point
        result.timing.error = f"{type(error).__name__}: {error}"[:200]
        return result
    result.timing.e2el = time.perf_counter() - start
    result.timing.output_tokens = result.timing.output_tokens or timer.num_chunks
    result.timing.is_success = timer.num_chunks > 0 and not result.timing.error
    return result


def _take_chunk(chunk: dict, result: ChatResult, timer: ChunkTimer) -> None:
    if "error" in chunk:
        result.timing.error = str(chunk["error"])[:200]
    if chunk.get("usage"):
        result.timing.output_tokens = chunk["usage"].get("completion_tokens", 0)
        result.timing.prompt_len = chunk["usage"].get("prompt_tokens", 0)
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            timer.tick(result.timing)
        result.content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            entry = result.tool_calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
            function = call.get("function") or {}
            entry["name"] += function.get("name") or ""
            entry["arguments"] += function.get("arguments") or ""


def check_output(request: ChatRequest, result: ChatResult) -> str:
    """'' for a valid constrained output, else what is wrong with it."""
    import jsonschema

    if not result.timing.is_success:
        return f"failed: {result.timing.error}"
    try:
        if request.spec_key == "tools":
            if not result.tool_calls:
                return f"no tool call (finish_reason {result.finish_reason}): {result.content[:80]!r}"
            calls = list(result.tool_calls.values())
            if result.finish_reason == "length":
                calls = calls[:-1]  # cut off by max_tokens: the last call's arguments are partial
            for call in calls:
                jsonschema.validate(json.loads(call["arguments"], strict=False), TOOL_PARAMETERS[call["name"]])
            return ""
        # strict=False: the grammar libraries let a string hold raw control characters.
        jsonschema.validate(json.loads(result.content, strict=False), SCHEMAS[request.spec_key])
        return ""
    except (ValueError, KeyError, jsonschema.ValidationError) as error:
        return f"{type(error).__name__}: {str(error)[:120]} in {result.content[:80] or result.tool_calls}"
