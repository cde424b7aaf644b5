"""The engine core's structured-output state, beside the scheduler: backends, the compile threads
(compile_pool.py), an LRU of compiled grammars, and the per-step bitmask."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from pagedserve.engine.structured_outputs.backend import GrammarBackend
from pagedserve.engine.structured_outputs.compile_pool import CompilePool
from pagedserve.engine.structured_outputs.grammar_cache import GrammarCache
from pagedserve.engine.structured_outputs.reasoning_end import ReasoningEnd
from pagedserve.engine.structured_outputs.request_grammar import RequestGrammar
from pagedserve.engine.structured_outputs.validation import BACKENDS, resolve_backend_name
from pagedserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled ahead of use: it builds the backend, and its pieces (strings, integers, objects) fill
# xgrammar's compile cache, which later schemas share.
PREWARM_SPEC = StructuredOutputsParams(
    json={"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}
)


class StructuredOutputManager:
    """Compiles off the step loop; the loop only polls futures, fills bitmask rows and advances
    matchers. Backends are built on first use, in the pool (xgrammar reads the whole vocabulary)."""

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: list[int], backend: str = "auto",
        compile_timeout_s: float = 30.0, max_workers: int = 2, cache_size: int = 256, reasoning_parser: str | None = None,
    ):
        # Loaded when first needed (the first constrained request, or a reasoning parser at
        # start): an engine that never constrains never reads a tokenizer.
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = None
        self.vocab_size = vocab_size  # the logits' width, padding included
        self.stop_token_ids = list(stop_token_ids)
        self.backend_setting = backend
        self.compile_timeout_s = compile_timeout_s
        self.pool = CompilePool(max_workers)
        self.cache = GrammarCache(cache_size)
        self._backends: dict[str, GrammarBackend] = {}
        self._backends_lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        # Set: a grammar applies only once the request's reasoning has ended.
        self.reasoning_end = ReasoningEnd.for_parser(reasoning_parser, self.tokenizer) if reasoning_parser else None

    @property
    def tokenizer(self) -> Any:
        with self._tokenizer_lock:  # (the compile threads build backends from it)
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    @property
    def num_bitmask_words(self) -> int:
        return (self.vocab_size + 31) // 32

    def prewarm(self) -> concurrent.futures.Future:
        """Build the default backend (the tokenizer, the vocabulary tables) and compile a small
        schema in the pool now, rather than on the first constrained request: on a fresh server
        that request paid about a second more for them (SmolLM2). The step loop never waits for
        it; a request that comes first shares the same backend build. A failure is only logged:
        the first request meets it again and says why."""
        return self.pool.submit(self._prewarm)

    def _prewarm(self) -> None:
        started = time.monotonic()
        try:
            name = resolve_backend_name(PREWARM_SPEC, self.backend_setting)
            self._backend(name).compile(PREWARM_SPEC)
        except Exception as error:  # noqa: BLE001 - reported, not raised: no request waits on it
            logger.warning("structured outputs: building the grammar backend ahead of use failed: %s", error)
            return
        logger.info("structured outputs: %s ready in %.2f s", name, time.monotonic() - started)

    def grammar_for(self, params: StructuredOutputsParams) -> RequestGrammar:
        """Start (or share) the compilation of a request's grammar. ValueError on a spec no
        allowed backend takes (checked at once, cheaply)."""
        name = resolve_backend_name(params, self.backend_setting)
        future = self.cache.get_or_submit((name, params.cache_key()), lambda: self.pool.submit(self._compile, name, params))
        return RequestGrammar(future, time.monotonic(), self.compile_timeout_s, params.kind, self.pool.abandon)

    def _compile(self, name: str, params: StructuredOutputsParams) -> tuple[GrammarBackend, Any]:
        backend = self._backend(name)
        started = time.monotonic()
        compiled = backend.compile(params)
        logger.debug("compiled a %s grammar with %s in %.3f s", params.kind, name, time.monotonic() - started)
        return backend, compiled

    def _backend(self, name: str) -> GrammarBackend:
        with self._backends_lock:
            if name not in self._backends:
                self._backends[name] = BACKENDS[name](self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._backends[name]

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> np.ndarray:
        """One packed row per grammar (int32; bit i of word i // 32 set: token i allowed)."""
        # numpy's fill, not torch.full: torch runs a fill this size on its OpenMP threads, and in a
        # served engine (other processes on the cores) waiting for a preempted thread cost up to
        # 7% of the engine core's time at 64 constrained rows.
        bitmask = torch.from_numpy(np.full((len(grammars), self.num_bitmask_words), -1, dtype=np.int32))
        by_kind: dict[type, tuple[list, list[int]]] = {}  # matcher class -> (matchers, rows)
        for row, grammar in enumerate(grammars):
            matchers, rows = by_kind.setdefault(type(grammar.matcher), ([], []))
            matchers.append(grammar.matcher)
            rows.append(row)
        for kind, (matchers, rows) in by_kind.items():
            kind.fill_rows(matchers, bitmask, rows)
        return bitmask.numpy()

    def wait_for_any(self, grammars: list[RequestGrammar], timeout_s: float) -> None:
        """Nothing else to do this step: sleep until a compilation ends (or `timeout_s`), rather
        than spin the step loop while the pool works."""
        pending = [g.future for g in grammars if not g.future.done()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def shutdown(self) -> None:
        self.pool.shutdown()
