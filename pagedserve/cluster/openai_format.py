"""OpenAI's response and chunk bodies, built from the engine's `CompletionOutput`s."""

from __future__ import annotations

import time
from typing import Any

from pagedserve.engine.request_output import CompletionOutput, Logprob


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def envelope(object_type: str, response_id: str, model: str, choices: list[dict], created: int | None = None) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": object_type,
        "created": created or int(time.time()),
        "model": model,
        "choices": choices,
    }


# ---- completions ------------------------------------------------------------------------------


def completion_choice(index: int, completion: CompletionOutput, num_top: int, text_offset: int = 0) -> dict[str, Any]:
    return {
        "index": index,
        "text": completion.text,
        "logprobs": completion_logprobs(completion, num_top, text_offset) if completion.logprobs is not None else None,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


MIN_JSON_LOGPROB = -9999.0


def completion_logprobs(completion: CompletionOutput, num_top: int, text_offset: int) -> dict[str, Any]:
    """The legacy completions format: parallel lists, top_logprobs as {token: logprob}."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        sampled = entry[token_id]
        tokens.append(sampled.decoded_token)
        token_logprobs.append(json_logprob(sampled.logprob))
        top.append({lp.decoded_token: json_logprob(lp.logprob) for lp in _top(entry, num_top)})
        offsets.append(offset)
        offset += len(sampled.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


# ---- chat -------------------------------------------------------------------------------------


def chat_choice(index: int, completion: CompletionOutput, num_top: int) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": chat_logprobs(completion, num_top) if completion.logprobs is not None else None,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


def chat_chunk_choice(index: int, completion: CompletionOutput, num_top: int, first: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": completion.text}
    if first:
        delta["role"] = "assistant"
    return {
        "index": index,
        "delta": delta,
        "logprobs": chat_logprobs(completion, num_top) if completion.logprobs is not None else None,
        "finish_reason": completion.finish_reason,
    }


def chat_logprobs(completion: CompletionOutput, num_top: int) -> dict[str, Any]:
    content = []
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        sampled = entry[token_id]
        item = _chat_token(sampled)
        item["top_logprobs"] = [_chat_token(lp) for lp in _top(entry, num_top)]
        content.append(item)
    return {"content": content}


def _chat_token(lp: Logprob) -> dict[str, Any]:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": json_logprob(lp.logprob), "bytes": list(token.encode("utf-8"))}


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: a token a grammar forbids has -inf, which strict JSON (and the
    response encoder) refuses; vLLM's front end sends -9999.0 in its place, and so do we."""
    return max(value, MIN_JSON_LOGPROB)


def _top(entry: dict[int, Logprob], num_top: int) -> list[Logprob]:
    """The top-N alternatives by rank (the entry also holds the sampled token, whatever its rank)."""
    return sorted((lp for lp in entry.values() if lp.rank <= num_top), key=lambda lp: lp.rank)
