"""Prompts in, token ids out: tokenization and every check a request must pass before it is
queued. Bad input stops here with a `ValueError` that says what was wrong and what is allowed;
nothing of it reaches the scheduler or a worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.engine.lora_registry import LoRARegistry
from pagedserve.engine.tokenizer import TextLimit
from pagedserve.lora_request import LoRARequest
from pagedserve.inputs import MAX_CACHE_SALT_CHARS, PromptType
from pagedserve.engine.structured_outputs.validation import validate_structured_outputs
from pagedserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class ResumeState:
    """A request that another replica began and had to hand over (it was stopping): what its
    client already received. The request goes on from there as if undisturbed: these tokens
    count as outputs, not prompt (max_tokens, penalties and per-position seeds hold), and only
    text past `num_sent_chars` is emitted. Only streams (DELTA outputs) with n == 1 resume."""

    output_token_ids: list[int]  # the tokens the client received, in order
    num_sent_chars: int  # characters of their text the client received (the rest was held back)
    cumulative_logprob: float | None = None  # the sum so far, when the request asked for logprobs


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    resume: ResumeState | None = None  # set for a request handed over from another replica
    cache_salt: str | None = None  # the tenant's: its prompts share cached blocks only with each other
    lora_request: LoRARequest | None = None  # its adapter (checked by the front end's LoRARegistry)


class InputProcessor:
    def __init__(self, tokenizer: Any, engine_config: EngineConfig, model_config: ModelConfig, loras: LoRARegistry | None = None):
        """No check against the KV cache's size is needed: the engine caps max_model_len to what
        the cache holds, and no request outgrows max_model_len."""
        self.tokenizer = tokenizer
        self.engine_config = engine_config
        self.model_config = model_config
        self._text_limit: TextLimit | None = None  # computed at the first text prompt
        self.loras = loras or LoRARegistry(engine_config)

    def process(
        self, prompt: PromptType, params: SamplingParams, resume: ResumeState | None = None, lora_request: LoRARequest | None = None
    ) -> ProcessedPrompt:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        lora_request = self.loras.check(lora_request)
        processed = self._tokenize(prompt)
        processed.lora_request = lora_request
        self._check_prompt(processed.prompt_token_ids)
        self._check_params(params)
        if resume is not None:
            self._check_resume(resume, len(processed.prompt_token_ids), params)
            processed.resume = resume
        return processed

    def _tokenize(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, str):
            return ProcessedPrompt(prompt, self._encode(prompt))
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt keys {sorted(unknown)}; allowed: 'prompt' or 'prompt_token_ids', and 'cache_salt'")
            salt = _cache_salt(prompt.get("cache_salt"))
            if "prompt_token_ids" in prompt:
                return ProcessedPrompt(prompt.get("prompt"), self._token_ids(prompt["prompt_token_ids"]), cache_salt=salt)
            if isinstance(prompt.get("prompt"), str):
                return ProcessedPrompt(prompt["prompt"], self._encode(prompt["prompt"]), cache_salt=salt)
        raise ValueError(
            f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': list[int]}}; got {type(prompt).__name__}"
        )

    def _encode(self, text: str) -> list[int]:
        """Token ids of a text that may fit in max_model_len; a longer one is refused unencoded."""
        if self._text_limit is None:
            self._text_limit = TextLimit.of(self.tokenizer, self.model_config.max_model_len)
        self._text_limit.check(len(text), "prompt")
        return self.tokenizer.encode(text)

    def _token_ids(self, token_ids: Any) -> list[int]:
        if not isinstance(token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in token_ids
        ):
            raise ValueError("prompt_token_ids must be a list of integers")
        return list(token_ids)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it must hold at least one token")
        max_len = self.model_config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len={max_len}")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _check_params(self, params: SamplingParams) -> None:
        if params.n > self.engine_config.max_n:
            raise ValueError(f"n={params.n} exceeds the engine's max_n={self.engine_config.max_n}")
        limit = self.engine_config.max_logprobs
        if params.logprobs is not None and params.logprobs > limit:
            raise ValueError(f"logprobs={params.logprobs} exceeds the engine's max_logprobs={limit}")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.structured_outputs is not None:  # a spec no backend takes fails here, alone
            validate_structured_outputs(params.structured_outputs, self.engine_config.structured_outputs_backend)
        bad = [t for t in params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def _check_resume(self, resume: ResumeState, num_prompt_tokens: int, params: SamplingParams) -> None:
        """A resumed request must still have a token to generate, inside every limit."""
        if params.n != 1 or params.output_kind != RequestOutputKind.DELTA:
            raise ValueError(f"only a stream (DELTA outputs) with n=1 can resume; got n={params.n}, output_kind={params.output_kind.name}")
        token_ids = self._token_ids(resume.output_token_ids)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"resumed output token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if resume.num_sent_chars < 0:
            raise ValueError(f"num_sent_chars={resume.num_sent_chars} must be >= 0")
        max_len = self.model_config.max_model_len
        if num_prompt_tokens + len(token_ids) >= max_len:
            raise ValueError(f"the prompt and the {len(token_ids)} resumed outputs reach max_model_len={max_len}: nothing is left to generate")
        if params.max_tokens is not None and len(token_ids) >= params.max_tokens:
            raise ValueError(f"{len(token_ids)} resumed outputs reach max_tokens={params.max_tokens}: nothing is left to generate")


def _cache_salt(salt: Any) -> str | None:
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    return salt
