"""xgrammar (the default backend): a spec becomes an `xgr.Grammar` (tokenizer-free, cheap), then a
`CompiledGrammar` for the model's vocabulary (the costly part, in the thread pool)."""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from pagedserve.engine.structured_outputs.backend import COMPACT_SEPARATORS, GrammarBackend, GrammarMatcher
from pagedserve.engine.structured_outputs.grammar_text import choice_to_ebnf, is_lark
from pagedserve.sampling_params import StructuredOutputsParams

# xgrammar's own compile cache (shared pieces of grammars), in bytes; vLLM allows 512 MiB.
COMPILER_CACHE_BYTES = 256 * 2**20


class XgrammarMatcher(GrammarMatcher):
    _batch: Any = None  # one xgr.BatchGrammarMatcher, made on the first batched fill

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    @classmethod
    def fill_rows(cls, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        if len(matchers) < 2:
            return super().fill_rows(matchers, bitmask, rows)
        if cls._batch is None:
            import xgrammar as xgr

            # One thread: xgrammar's masks are mostly precomputed, so a fill is a few microseconds a
            # row and a handoff to worker threads cost more than it saved (measured: 64 rows
            # 0.14 ms in one thread, 0.5 ms in two, on a 2-core Zen 4).
            cls._batch = xgr.BatchGrammarMatcher(max_threads=1)
        cls._batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask, rows)


class XgrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        """`vocab_size`: the logits' width. Ids past the tokenizer's own size (padding) are never
        allowed: xgrammar treats them as special tokens."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        # One thread per compile (2 in flight). The manager keeps its own LRU of whole compiled
        # grammars; xgrammar's cache, on as well, shares the pieces schemas have in common (string
        # and number rules and their token masks): a second, different schema compiled in 2 ms
        # instead of 0.35 s, and the first in half the time (benchmarks/structured_outputs.py).
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True, cache_limit_bytes=COMPILER_CACHE_BYTES)

    @staticmethod
    def check(params: StructuredOutputsParams) -> None:
        to_grammar(params)

    def compile(self, params: StructuredOutputsParams) -> Any:
        return self.compiler.compile_grammar(to_grammar(params))

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        import xgrammar as xgr

        return XgrammarMatcher(xgr.GrammarMatcher(compiled))


def to_grammar(params: StructuredOutputsParams) -> Any:
    """The spec as an xgrammar Grammar; ValueError naming the field and xgrammar's reason."""
    import xgrammar as xgr

    kind = params.kind
    layout = {"any_whitespace": not params.disable_any_whitespace}
    if params.disable_any_whitespace:
        layout["separators"] = COMPACT_SEPARATORS
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(params.spec, **layout)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', **layout)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_to_ebnf(params.choice))
        if kind == "grammar":
            if is_lark(params.grammar):
                raise ValueError("a Lark grammar is not supported by xgrammar (it takes EBNF/GBNF): use the guidance backend")
            return xgr.Grammar.from_ebnf(params.grammar)
        return _structural_tag(xgr, params.structural_tag)
    except ValueError as error:
        raise ValueError(f"StructuredOutputsParams.{kind} is invalid for xgrammar: {_first_lines(error)}") from None
    except RuntimeError as error:  # xgrammar reports parse errors as RuntimeError subclasses
        raise ValueError(f"StructuredOutputsParams.{kind} is invalid for xgrammar: {_first_lines(error)}") from None


def _structural_tag(xgr: Any, text: str) -> Any:
    """xgrammar's structural tag: the current format, or vLLM's legacy {structures, triggers}."""
    try:
        tag = json.loads(text)
    except ValueError as error:
        raise ValueError(f"not valid JSON: {error}") from None
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))
    return xgr.Grammar.from_structural_tag(text)


# xgrammar prefixes its messages with "[07:11:32] /project/cpp/regex_converter.cc:83: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _first_lines(error: BaseException, limit: int = 400) -> str:
    text = _LOG_PREFIX.sub("", str(error).strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."
