"""OpenAI's request bodies (with vLLM's extras) as pydantic models, and their mapping onto
`SamplingParams`. Validation happens here, where the request enters: an unknown field, a value
out of range or a feature we do not serve is a 400 that names it. Models are strict, as the JSON
schema they publish is: `true` is not token id 1 and "16" is not a max_tokens."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pagedserve.cluster.structured_requests import FieldError, ResponseFormat, StructuredOutputsField, structured_outputs_params
from pagedserve.cluster.tool_requests import ChatTool, ForcedCall, ToolCall, ToolChoice, check_tools, forced_call, resolved_tool_choice
from pagedserve.inputs import MAX_CACHE_SALT_CHARS, TokensPrompt, tokens_prompt
from pagedserve.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RequestOutputKind,
    SamplingParams,
)



def _encodable(value: Any) -> Any:
    """Text that reaches the tokenizer: JSON may spell a lone UTF-16 surrogate ("\\ud800"),
    which no tokenizer can encode (it raised a TypeError in the engine: a 500)."""
    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(f"unpaired UTF-16 surrogate at position {error.start}: not valid Unicode text") from None
    return value


def _bounded_stop(value: Any) -> Any:
    """Stop strings are matched against every sample's new text each step: their count and
    length are bounded (as SamplingParams bounds them, but here the 400 names the OpenAI field)."""
    stops = [value] if isinstance(value, str) else value or []
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"a stop string may hold at most {MAX_STOP_STRING_CHARS} characters, got one of {longest}")
    return _encodable(value)


def _bounded_stop_token_ids(value: list[int] | None) -> list[int] | None:
    if value is not None and len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {len(value)}")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    n: int = Field(1, ge=1)  # at most the engine's max_n (prompts x n for completions)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None  # accepted and ignored, as OpenAI's abuse-tracking field
    # vLLM extras
    # Prefix-cache hits only among requests with the same salt (default: the API key's digest).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Structured outputs (structured_requests.py): OpenAI's field, then vLLM's.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None = None, forced_spec: dict | None = None
    ) -> SamplingParams:
        """Raises ValueError (naming the field) for values SamplingParams does not allow.
        `defaults`: the model's generation config, for the fields the request omits;
        `forced_spec`: the constraint a forced tool call imposes (tool_formats.py)."""
        optional = {**(defaults or {})}
        optional.update({name: value for name, value in {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
        }.items() if value is not None})
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=structured_outputs_params(self.response_format, self.structured_outputs, forced_spec),
            logit_bias=self.token_logit_bias(),
            **optional,
        )

    def token_logit_bias(self) -> dict[int, float] | None:
        """`logit_bias` with integer token ids (the vocabulary bound is the engine's check)."""
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise FieldError("logit_bias", f"{len(self.logit_bias)} entries exceed the limit of {MAX_LOGIT_BIAS_ENTRIES}")
        bias = {}
        for key, value in self.logit_bias.items():
            if not key.isdigit() or len(key) > 9:
                raise FieldError("logit_bias", f"key {key[:20]!r} is not a token id (a non-negative integer as text)")
            if not -100 <= value <= 100:
                raise FieldError("logit_bias", f"bias {value!r} for token {key} is outside [-100, 100]")
            bias[int(key)] = float(value)
        return bias

    _check_stop = field_validator("stop")(_bounded_stop)
    _check_stop_token_ids = field_validator("stop_token_ids")(_bounded_stop_token_ids)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self


# A completion prompt: text, a list of texts, token ids, or a list of token-id lists.
PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0)  # at most the engine's max_logprobs
    echo: Literal[False] = False  # echoing the prompt is not served
    best_of: int | None = None
    suffix: None = None  # insertion is not served

    _check_prompt = field_validator("prompt")(_encodable)

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported")
        return self

    def prompts(self) -> list[Union[str, TokensPrompt]]:
        """The request's prompts in the engine's form (texts, or dicts of token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [tokens_prompt(list(prompt))]
        if not prompt:
            raise ValueError("prompt must not be an empty list")
        return [p if isinstance(p, str) else tokens_prompt(list(p)) for p in prompt]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str

    _check_text = field_validator("text")(_encodable)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # an assistant's calls (agent loops)
    tool_call_id: str | None = None  # a tool message: the call it answers

    _check_content = field_validator("content")(_encodable)

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls is only allowed on assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.as_template_call() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most the engine's max_logprobs
    add_generation_prompt: bool = True  # vLLM extra
    tools: list[ChatTool] | None = None  # bounds: tool_requests.check_tools
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def effective_tool_choice(self) -> ToolChoice:
        return resolved_tool_choice(self.tools, self.tool_choice)

    def forced_tool_call(self) -> ForcedCall | None:
        """Checks the tools' bounds (FieldError), then the call(s) tool_choice forces."""
        check_tools(self.tools, self.tool_choice)
        return forced_call(self.tools or [], self.effective_tool_choice, self.parallel_tool_calls)

    @property
    def is_compact_json(self) -> bool:
        return self.structured_outputs is None or self.structured_outputs.disable_any_whitespace

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    _check_prompt = field_validator("prompt")(_encodable)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: int
    param: str | None = None


class ErrorResponse(BaseModel):
    """Every error's body (OpenAI's shape)."""

    error: ErrorDetail
