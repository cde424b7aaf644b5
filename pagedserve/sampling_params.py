"""Per-request sampling knobs with vLLM's names and ranges, validated at construction.

This module imports nothing from the project: the engine validates requests with it and the
workers' sampler reads it (it travels inside `NewRequestData`).
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass
from typing import Any

# Below this temperature a request is greedy (as vLLM): dividing by it would overflow.
GREEDY_TEMPERATURE_EPS = 1e-5
# Stop conditions are checked every step for every sample, so their size is bounded: 200k stop
# strings once cost 50 ms per token and stalled every stream on the replica (issue 19).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
# OpenAI's own limit on logit_bias entries: the biases travel to every rank in each new request.
MAX_LOGIT_BIAS_ENTRIES = 300


class SamplingParamError(ValueError):
    """A field of SamplingParams given a value it does not allow; `field` names it (an HTTP 400
    reports it as the request's `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries the whole text and token ids so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # a single output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample one request's completion(s). Bad values raise `SamplingParamError`."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A grammar the completion must follow (JSON schema, regex, choice, EBNF...); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before sampling.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.is_greedy:
            # Truncation is meaningless for argmax; normalising keeps the sampler's fast path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def stop_buffer_length(self) -> int:
        """Characters held back from streamed text: they may be the start of a stop string."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def for_child(self, index: int) -> SamplingParams:
        """Params of the `index`-th of `n` completions: each is its own request with n=1.

        A seeded parent gives child i the seed `seed + i`, so the n completions differ but the
        whole set is reproducible (as vLLM does).
        """
        child = copy.copy(self)
        child.n = 1
        if self.seed is not None:
            child.seed = self.seed + index
        return child

    def sampler_params(self) -> SamplerParams:
        """The part the workers' sampler reads, which travels to every rank (see SamplerParams)."""
        return SamplerParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, seed=self.seed,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(self.stop_token_ids) if self.min_tokens > 0 else (),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logprobs=self.logprobs, logit_bias=self.logit_bias,
        )

    def clone(self, **changes: Any) -> SamplingParams:
        child = copy.copy(self)
        for name, value in changes.items():
            setattr(child, name, value)
        return child

    def _check_types(self) -> None:
        _expect(self, "n", int)
        _expect(self, "temperature", float)
        _expect(self, "top_p", float)
        _expect(self, "top_k", int)
        _expect(self, "min_p", float)
        _expect(self, "seed", int, optional=True)
        _expect(self, "max_tokens", int, optional=True)
        _expect(self, "min_tokens", int)
        _expect(self, "presence_penalty", float)
        _expect(self, "frequency_penalty", float)
        _expect(self, "repetition_penalty", float)
        _expect(self, "logprobs", int, optional=True)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "a bool")
        if not isinstance(self.output_kind, RequestOutputKind):
            _fail("output_kind", self.output_kind, "a RequestOutputKind")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            _fail("structured_outputs", so, "a StructuredOutputsParams or None")
        self._check_logit_bias()
        stop = self.stop
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                _fail("stop", stop, "a string or a list of strings")
        if isinstance(stop, str):
            stop = [stop]
        _check_stop_bounds(stop or [])
        ids = self.stop_token_ids
        if ids is not None and isinstance(ids, (list, tuple)) and len(ids) > MAX_STOP_TOKEN_IDS:
            _fail("stop_token_ids", _Count(len(ids), "token ids"), f"at most {MAX_STOP_TOKEN_IDS} token ids")
        if ids is not None and (
            not isinstance(ids, (list, tuple))
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
        ):
            _fail("stop_token_ids", ids, "a list of non-negative token ids")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            _fail("logit_bias", bias, "a dict of token id -> bias, or None")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            _fail("logit_bias", _Count(len(bias), "entries"), f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
        for token_id, value in bias.items():
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                _fail("logit_bias", token_id, "non-negative integer token ids as keys")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                _fail("logit_bias", value, "biases between -100 and 100")
        self.logit_bias = {token_id: float(value) for token_id, value in bias.items()} or None

    def _check_ranges(self) -> None:
        if self.n < 1:
            _fail("n", self.n, "n >= 1")
        if self.temperature < 0:
            _fail("temperature", self.temperature, "temperature >= 0")
        if not 0 < self.top_p <= 1:
            _fail("top_p", self.top_p, "0 < top_p <= 1")
        if self.top_k < -1:
            _fail("top_k", self.top_k, "-1 or 0 (disabled) or top_k >= 1")
        if not 0 <= self.min_p <= 1:
            _fail("min_p", self.min_p, "0 <= min_p <= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                _fail(name, getattr(self, name), f"-2 <= {name} <= 2")
        if self.repetition_penalty <= 0:
            _fail("repetition_penalty", self.repetition_penalty, "repetition_penalty > 0")
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail("max_tokens", self.max_tokens, "max_tokens >= 1 (or None: up to max_model_len)")
        if self.min_tokens < 0:
            _fail("min_tokens", self.min_tokens, "min_tokens >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", self.min_tokens, f"min_tokens <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            _fail("logprobs", self.logprobs, "logprobs >= 0 (or None)")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            _fail("seed", self.seed, "a 64-bit signed integer")


@dataclass(frozen=True)
class SamplerParams:
    """What the workers' sampler needs of one request: sent to every rank in each step that
    schedules the request whole. Stop strings and output options stay in the engine, so a step's
    size depends on its tokens only (a too-large step once killed the engine, issue 19). Field
    names are SamplingParams' own, so the sampler reads either."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    min_tokens: int
    ignore_eos: bool
    # Banned while min_tokens is not reached (at most MAX_STOP_TOKEN_IDS); empty when min_tokens
    # is 0, since the engine alone stops a request on them.
    stop_token_ids: tuple[int, ...]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int | None
    logit_bias: dict[int, float] | None = None  # at most MAX_LOGIT_BIAS_ENTRIES entries

    is_greedy = SamplingParams.is_greedy
    has_penalties = SamplingParams.has_penalties


def _check_stop_bounds(stop: list[str] | tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        _fail("stop", _Count(len(stop), "strings"), f"at most {MAX_STOP_STRINGS} stop strings")
    for text in stop:
        if text == "":
            _fail("stop", stop, "non-empty strings")
        if len(text) > MAX_STOP_STRING_CHARS:
            _fail("stop", _Count(len(text), "characters"), f"at most {MAX_STOP_STRING_CHARS} characters per stop string")


class _Count:
    """Stands for an over-long value in an error message: the message must not echo it back."""

    def __init__(self, count: int, unit: str):
        self.count, self.unit = count, unit

    def __repr__(self) -> str:
        return f"<{self.count} {self.unit}>"


def _expect(params: SamplingParams, name: str, kind: type, optional: bool = False) -> None:
    value = getattr(params, name)
    if value is None and optional:
        return
    # bool is an int subclass: reject it so `max_tokens=True` is not taken for 1.
    ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
    if not ok:
        wanted = "a number" if kind is float else "an integer"
        _fail(name, value, wanted + (" or None" if optional else ""))
    if kind is float:
        if not math.isfinite(value):
            _fail(name, value, "a finite number")
        setattr(params, name, float(value))


def _fail(name: str, value: Any, allowed: str) -> None:
    raise SamplingParamError(name, f"SamplingParams.{name}={value!r} is invalid: allowed is {allowed}")


# The kinds of constraint, in vLLM's field names; exactly one is set per request.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# A spec bigger than this is refused before any compiler sees it (a schema is rarely > a few KB).
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024


@dataclass
class StructuredOutputsParams:
    """One grammar a completion must follow, as vLLM 0.32 spells it. Bad values raise `ValueError`.

    Exactly one of the kind fields is set: `json` (a JSON schema, as a dict or its JSON text),
    `regex`, `choice` (the output is one of these strings), `grammar` (EBNF/GBNF, or Lark, as
    vLLM accepts), `json_object=True` (any JSON object) or `structural_tag` (xgrammar's
    structural tag, as JSON text).

    `disable_any_whitespace` defaults to True, unlike vLLM: JSON is emitted compact (no free
    whitespace between tokens), because weak models given free whitespace loop on it until
    `max_tokens`. Set it to False to allow any whitespace.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = True
    # JSON schemas: treat objects with no `additionalProperties` as closed (vLLM's flag).
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        self._check_kind_types()
        kinds = self.kinds_set()
        if len(kinds) != 1:
            found = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                "StructuredOutputsParams needs exactly one of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)} set; found {found}"
            )
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                _fail_so(name, getattr(self, name), "a bool")
        if len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            _fail_so(self.kind, f"<{len(self.spec)} characters>",
                     f"a spec of at most {MAX_STRUCTURED_SPEC_CHARS} characters")

    def kinds_set(self) -> list[str]:
        return [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        """The one constraint kind this request uses ("json", "regex", ...)."""
        return self.kinds_set()[0]

    @property
    def spec(self) -> str:
        """The constraint as one canonical string: with `kind` and the flags, the cache key."""
        import json as _json

        value = getattr(self, self.kind)
        if self.kind == "json":
            # Key order is kept: a schema's property order is the order the JSON is generated in.
            schema = _json.loads(value) if isinstance(value, str) else value
            return _json.dumps(schema, separators=(",", ":"))
        if self.kind == "choice":
            return _json.dumps(value)
        if self.kind == "json_object":
            return ""
        return value

    def cache_key(self) -> tuple:
        return (self.kind, self.spec, self.disable_any_whitespace,
                self.disable_additional_properties)

    def _check_kind_types(self) -> None:
        import json as _json

        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = _json.loads(self.json)
                except ValueError as e:
                    _fail_so("json", _short(self.json), f"a JSON schema (not valid JSON: {e})")
                if not isinstance(parsed, (dict, bool)):
                    _fail_so("json", _short(self.json), "a JSON schema (an object)")
            elif not isinstance(self.json, dict):
                _fail_so("json", _short(self.json), "a JSON schema as a dict or a JSON string")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                _fail_so(name, _short(value), "a non-empty string")
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
            if not ok or not all(isinstance(c, str) and c for c in self.choice):
                _fail_so("choice", _short(self.choice), "a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            _fail_so("json_object", self.json_object, "True, False or None")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fail_so(name: str, value: Any, allowed: str) -> None:
    raise ValueError(
        f"StructuredOutputsParams.{name}={value if isinstance(value, str) else repr(value)} "
        f"is invalid: allowed is {allowed}"
    )
