"""Hostile input against the live Serve app: hand-written malformed bodies, then schemathesis
generating requests from the server's own /openapi.json (tools/fuzz_http.py, bounded here).

Whatever arrives: no 5xx, no traceback text, every refusal in OpenAI's error shape and short (a
10 MB body is not echoed back), and afterwards the server is healthy, still answers correctly and
holds no KV blocks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import requests

from pagedserve.cluster.server_config import ServerConfig
from tests.cluster.conftest import deploy, metric_values, wait_until
from tests.models import TOKENIZER_VOCAB

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import fuzz_http  # noqa: E402

MODEL = "fuzz-llama"
APP = "fuzz-http"
PREFIX = "/fuzz"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def base_url(serve_url, model_dirs):
    from ray import serve

    config = ServerConfig(model=str(model_dirs["llama"]), served_model_name=MODEL, engine={"max_model_len": MAX_MODEL_LEN})
    deploy(config, APP, PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


def _json(value) -> bytes:
    return json.dumps(value).encode()


def _completion(**fields) -> bytes:
    return _json({"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields})


def _chat(**fields) -> bytes:
    return _json({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields})


def _raw(text: str) -> bytes:
    """A body Python's json module would never write (NaN, Infinity, bare tokens)."""
    return text.replace("MODEL", MODEL).encode()


DEEP = 10_000
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# (route, body, content type) -> must be refused with a 4xx, never a 5xx.
MALFORMED = {
    # wrong types
    "prompt is an object": (COMPLETIONS, _completion(prompt={"text": "x"}), None),
    "max_tokens is a string": (COMPLETIONS, _completion(max_tokens="ten"), None),
    "max_tokens is a numeric string": (COMPLETIONS, _completion(max_tokens="16"), None),
    "token ids are booleans": (COMPLETIONS, _completion(prompt=[True, False]), None),
    "stream is 1": (COMPLETIONS, _completion(stream=1), None),
    "temperature is a list": (COMPLETIONS, _completion(temperature=[1]), None),
    "stream is a string": (COMPLETIONS, _completion(stream="maybe"), None),
    "n is a float": (COMPLETIONS, _completion(n=1.5), None),
    "stop is a number": (COMPLETIONS, _completion(stop=5), None),
    "model is a number": (COMPLETIONS, _json({"model": 5, "prompt": "x"}), None),
    "messages is a string": (CHAT, _chat(messages="hello"), None),
    "a message is a number": (CHAT, _chat(messages=[5]), None),
    "content parts are numbers": (CHAT, _chat(messages=[{"role": "user", "content": [1, 2]}]), None),
    "unknown role": (CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), None),
    "body is a list": (COMPLETIONS, _json([1, 2, 3]), None),
    "body is a string": (COMPLETIONS, _json("prompt"), None),
    "body is null": (COMPLETIONS, b"null", None),
    # huge numbers
    "max_tokens 1e308": (COMPLETIONS, _completion(max_tokens=1e308), None),
    "n 2**64": (COMPLETIONS, _completion(n=2**64), None),
    "seed 2**64": (COMPLETIONS, _completion(seed=2**64), None),
    "logprobs 2**64": (COMPLETIONS, _completion(logprobs=2**64), None),
    "top_logprobs 2**64": (CHAT, _chat(logprobs=True, top_logprobs=2**64), None),
    "token id 2**64": (COMPLETIONS, _completion(prompt=[2**64]), None),
    "token id 1e308": (COMPLETIONS, _completion(prompt=[1e308]), None),
    # NaN and infinities (not JSON, but Python's parser takes them)
    "temperature NaN": (COMPLETIONS, _raw('{"model": "MODEL", "prompt": "x", "temperature": NaN}'), None),
    "top_p Infinity": (COMPLETIONS, _raw('{"model": "MODEL", "prompt": "x", "top_p": Infinity}'), None),
    "max_tokens -Infinity": (COMPLETIONS, _raw('{"model": "MODEL", "prompt": "x", "max_tokens": -Infinity}'), None),
    "presence_penalty NaN": (CHAT, _raw('{"model": "MODEL", "messages": [{"role": "user", "content": "x"}], "presence_penalty": NaN}'), None),
    "repetition_penalty Infinity": (COMPLETIONS, _raw('{"model": "MODEL", "prompt": "x", "repetition_penalty": Infinity}'), None),
    # deep nesting
    "10,000 nested lists as the prompt": (COMPLETIONS, _raw('{"model": "MODEL", "prompt": ' + "[" * DEEP + "]" * DEEP + "}"), None),
    "10,000 nested lists as the body": (COMPLETIONS, _raw("[" * DEEP + "]" * DEEP), None),
    "10,000 nested objects": (COMPLETIONS, _raw('{"model": "MODEL", "prompt": "x", "user": ' + '{"a":' * DEEP + "1" + "}" * DEEP + "}"), None),
    "10,000 nested content parts": (CHAT, _raw('{"model": "MODEL", "messages": [{"role": "user", "content": ' + "[" * DEEP + "]" * DEEP + "}]}"), None),
    # enormous strings (past the body limit, and just under it)
    "10 MB prompt": (COMPLETIONS, _completion(prompt="a" * 10_000_000), None),
    "7 MB prompt": (COMPLETIONS, _completion(prompt="a " * 3_500_000), None),
    # invalid UTF-8 and broken JSON
    "invalid UTF-8 in the prompt": (COMPLETIONS, b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe\xc3"}', None),
    "a lone surrogate escape": (COMPLETIONS, _raw('{"model": "MODEL", "prompt": "\\ud800"}'), None),
    "truncated JSON": (COMPLETIONS, _completion()[:-5], None),
    "empty body": (COMPLETIONS, b"", None),
    "NUL bytes": (COMPLETIONS, b"\x00" * 64, None),
    # token ids out of range
    "token id past the vocabulary": (COMPLETIONS, _completion(prompt=[TOKENIZER_VOCAB + 5]), None),
    "negative token id": (COMPLETIONS, _completion(prompt=[-1]), None),
    "empty token list": (COMPLETIONS, _completion(prompt=[]), None),
    "a list of empty token lists": (COMPLETIONS, _completion(prompt=[[]]), None),
    "mixed prompt list": (COMPLETIONS, _completion(prompt=["x", [1, 2]]), None),
    "20,000 wrong prompt items": (COMPLETIONS, _completion(prompt=[{}] * 20_000), None),
    "detokenize past the vocabulary": ("/detokenize", _json({"model": MODEL, "tokens": [10**9]}), None),
    "detokenize a negative id": ("/detokenize", _json({"model": MODEL, "tokens": [-1]}), None),
    "stop_token_ids past the vocabulary": (COMPLETIONS, _completion(stop_token_ids=[2**40]), None),
    "prompt longer than max_model_len": (COMPLETIONS, _completion(prompt=[5] * (MAX_MODEL_LEN + 1)), None),
    # negative and out-of-range values
    "negative max_tokens": (COMPLETIONS, _completion(max_tokens=-1), None),
    "zero max_tokens": (COMPLETIONS, _completion(max_tokens=0), None),
    "negative max_completion_tokens": (CHAT, _chat(max_completion_tokens=-5), None),
    "negative n": (COMPLETIONS, _completion(n=-1), None),
    "negative temperature": (COMPLETIONS, _completion(temperature=-0.5), None),
    "top_p above 1": (COMPLETIONS, _completion(top_p=1.5), None),
    "negative top_logprobs": (CHAT, _chat(logprobs=True, top_logprobs=-1), None),
    # empty or absent fields
    "empty object": (COMPLETIONS, b"{}", None),
    "no prompt": (COMPLETIONS, _json({"model": MODEL}), None),
    "no model": (COMPLETIONS, _json({"prompt": "x"}), None),
    "no messages": (CHAT, _json({"model": MODEL}), None),
    "empty messages": (CHAT, _chat(messages=[]), None),
    "an empty message": (CHAT, _chat(messages=[{}]), None),
    "unknown field": (COMPLETIONS, _completion(frobnicate=True), None),
    "unknown model": (COMPLETIONS, _completion(model="no-such-model"), None),
    # wrong content types
    "text/plain": (COMPLETIONS, _completion(), "text/plain"),
    "form-encoded": (COMPLETIONS, b"model=x&prompt=y", "application/x-www-form-urlencoded"),
    "multipart": (COMPLETIONS, b"--b\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--b--\r\n", "multipart/form-data; boundary=b"),
    "JSON content type, XML body": (COMPLETIONS, b"<xml/>", "application/json"),
}
# Extreme but allowed: a max_tokens past max_model_len is capped by it, a top_k past the
# vocabulary keeps every token. Served (200), or refused cleanly; either way nobody else suffers.
EXTREME = {
    "max_tokens 2**64": (COMPLETIONS, _completion(max_tokens=2**64)),
    "top_k 2**64": (COMPLETIONS, _completion(top_k=2**64)),
    "temperature 1e308": (COMPLETIONS, _completion(temperature=1e308)),
    "a 400-digit integer": (COMPLETIONS, _raw('{"model": "MODEL", "prompt": "x", "max_tokens": ' + "9" * 400 + "}")),
    "seed 2**63 - 1": (COMPLETIONS, _completion(seed=2**63 - 1, temperature=1.0)),
    "min_tokens 2**64": (COMPLETIONS, _completion(min_tokens=2**64, max_tokens=None)),
    "repetition_penalty 1e308": (COMPLETIONS, _completion(repetition_penalty=1e308)),
    "7 MB stop string": (COMPLETIONS, _completion(stop=["b" * 7_000_000])),
}


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_body_is_a_clear_4xx(base_url, case):
    route, body, content_type = MALFORMED[case]
    response = requests.post(
        base_url + route, data=body, headers={"Content-Type": content_type or "application/json"}, timeout=120
    )
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    fuzz_http.assert_clean_error(response.status_code, response.headers.get("content-type", ""), response.content)


@pytest.mark.parametrize("case", list(EXTREME), ids=list(EXTREME))
def test_extreme_value_is_served_or_refused_cleanly(base_url, case):
    route, body = EXTREME[case]
    response = requests.post(base_url + route, data=body, headers={"Content-Type": "application/json"}, timeout=120)
    if response.status_code == 200:
        assert response.json()["usage"]["completion_tokens"] >= 1, response.text[:500]
    else:
        assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
        fuzz_http.assert_clean_error(response.status_code, response.headers.get("content-type", ""), response.content)


def test_server_healthy_and_idle_after_hostile_input(base_url):
    # After every hostile body above (tests run in file order).
    assert requests.get(base_url + "/health", timeout=60).status_code == 200
    answer = requests.post(base_url + COMPLETIONS, data=_completion(max_tokens=3), headers={"Content-Type": "application/json"}, timeout=120)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1, answer.text
    assert wait_until(lambda: _kv_usage(base_url) == 0.0, timeout=60)


def _kv_usage(base_url: str) -> float:
    values = metric_values(base_url)
    return values[("pagedserve:kv_cache_usage_perc", (("model_name", MODEL),))]


def test_schemathesis_finds_nothing(base_url):
    """A bounded run of tools/fuzz_http.py (the script runs longer ones): every operation in
    /openapi.json, schema-valid and schema-violating bodies, all of schemathesis' checks."""
    summary = fuzz_http.fuzz(base_url, max_examples=25, seed=0, model=MODEL)
    assert summary["failures"] == {}, json.dumps(summary["failures"], indent=1)
    assert summary["passed"], summary
    # The run reached the engine, not just the validators.
    assert summary["statuses"].get(200, 0) >= 20 and summary["statuses"].get(400, 0) >= 20, summary["statuses"]
