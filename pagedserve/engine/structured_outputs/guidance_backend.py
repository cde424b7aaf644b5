"""llguidance ('guidance'): much faster than xgrammar on some large schemas, and it reads Lark.
Its matcher builds token masks lazily, so "compiling" is validating the grammar against the
tokenizer; each matcher then parses on demand."""

from __future__ import annotations

import json
from typing import Any

import torch

from pagedserve.engine.structured_outputs.backend import BATCH_FILL_THREADS, COMPACT_SEPARATORS, GrammarBackend, GrammarMatcher
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.workers.cpu_binding import unbound


class GuidanceMatcher(GrammarMatcher):
    """llguidance stops as soon as nothing but EOS may follow (after a JSON object's `}`); here,
    as with xgrammar, the grammar terminates only once that stop token is sampled too. So the
    last token of a grammar-ended request is always a stop token, as the front end assumes."""

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int]):
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.is_stop_accepted = False

    def accept_token(self, token_id: int) -> bool:
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            return False
        self.is_stop_accepted = token_id in self.stop_token_ids and self.matcher.is_stopped()
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self.is_stop_accepted

    @classmethod
    def fill_rows(cls, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        if len(matchers) < 2:
            return super().fill_rows(matchers, bitmask, rows)
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask_par(_executor(), [(m.matcher, row) for m, row in zip(matchers, rows)], bitmask)


_EXECUTOR: Any = None


def _executor() -> Any:
    """llguidance's native thread pool for batched fills, made once per process."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        with unbound():  # its threads not on a bound step thread's one CPU (workers/cpu_binding.py)
            _EXECUTOR = llguidance.LLExecutor(num_threads=BATCH_FILL_THREADS)
    return _EXECUTOR


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import llguidance.hf

        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size, eos_token=list(stop_token_ids) or None)
        self.stop_token_ids = frozenset(stop_token_ids)

    @staticmethod
    def check(params: StructuredOutputsParams) -> None:
        import llguidance

        try:
            error = llguidance.LLMatcher.validate_grammar(to_grammar(params), None)
        except ValueError as conversion_error:  # ours name the field already
            error = str(conversion_error)
            if error.startswith("StructuredOutputsParams."):
                raise
        if error:
            raise ValueError(f"StructuredOutputsParams.{params.kind} is invalid for llguidance: {_short(error)}")

    def compile(self, params: StructuredOutputsParams) -> Any:
        import llguidance

        grammar = to_grammar(params)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"StructuredOutputsParams.{params.kind} is invalid for llguidance: {_short(error)}")
        return grammar

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, compiled)
        if matcher.is_error():
            raise ValueError(f"llguidance could not start the grammar: {_short(matcher.get_error())}")
        return GuidanceMatcher(matcher, self.stop_token_ids)


def to_grammar(params: StructuredOutputsParams) -> str:
    """The spec as llguidance's grammar JSON (as vLLM serializes it)."""
    import llguidance

    kind = params.kind
    if kind == "structural_tag":
        raise ValueError("StructuredOutputsParams.structural_tag is not supported by llguidance: use the xgrammar backend")
    if kind in ("json", "json_object"):
        schema = json.loads(params.spec) if kind == "json" else {"type": "object"}
        if params.disable_additional_properties:
            schema = close_objects(schema)
        layout = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.disable_any_whitespace:
            layout["item_separator"], layout["key_separator"] = COMPACT_SEPARATORS
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=layout)
    text = json.dumps(params.choice) if kind == "choice" else getattr(params, kind)
    return llguidance.grammar_from(kind, text)


def close_objects(schema: Any) -> Any:
    """vLLM's `disable_additional_properties`: every object schema that does not say otherwise
    gets `additionalProperties: false`."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: close_objects(value) for key, value in schema.items()}
    if (closed.get("type") == "object" or "properties" in closed) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _short(text: str, limit: int = 400) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."
