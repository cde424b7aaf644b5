"""One request's grammar: a compile future until it is ready, then a matcher that follows the
request's output tokens."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

import torch

from pagedserve.engine.structured_outputs.backend import GrammarMatcher


QUEUE_WAIT_FACTOR = 4


class RequestGrammar:
    """The matcher has consumed exactly `output_token_ids[:num_accepted]`. Its state is a function
    of the grammar and those tokens, so a matcher made late (the grammar compiled after outputs
    exist: a resumed or handed-over request) catches up by replaying them (`sync`)."""

    def __init__(self, future: Future, created_at: float, timeout_s: float, kind: str, abandon: Callable[[Future], Any] = lambda _: None):
        self.future = future  # -> (backend, compiled grammar)
        self.created_at = created_at  # time.monotonic()
        # A compile still running `timeout_s` after it started fails the request; one that has
        # waited QUEUE_WAIT_FACTOR times as long for a thread does too.
        self.timeout_s = timeout_s
        self.abandon = abandon  # told of a compile given up on: its thread stops counting
        self.kind = kind  # "json", "regex"...: for messages
        self.matcher: GrammarMatcher | None = None
        self.num_accepted = 0
        self.error: str | None = None  # why the request cannot go on, once it cannot

    @property
    def is_ready(self) -> bool:
        return self.matcher is not None

    def poll(self, output_token_ids: list[int], now: float) -> bool:
        """True once the matcher exists and has caught up; False while compiling, or for good
        once `error` is set."""
        if self.matcher is not None or self.error is not None:
            return self.error is None
        if not self.future.done():
            self.error = self._timeout_error(now)
            if self.error is not None:
                self.abandon(self.future)
            return False
        try:
            backend, compiled = self.future.result()
            self.matcher = backend.new_matcher(compiled)
        except Exception as error:  # a bad spec fails its request, never the engine
            self.error = f"{error}" if str(error).startswith("StructuredOutputsParams") else (
                f"StructuredOutputsParams.{self.kind} could not be compiled: {error}"
            )
            return False
        return self.sync(output_token_ids)

    def _timeout_error(self, now: float) -> str | None:
        started_at = getattr(self.future, "started_at", None)
        if started_at is not None and now > started_at + self.timeout_s:
            return (
                f"StructuredOutputsParams.{self.kind}: the grammar did not compile within "
                f"{self.timeout_s:g} s (structured_outputs_compile_timeout_s); simplify the spec"
            )
        if now > self.created_at + QUEUE_WAIT_FACTOR * self.timeout_s:
            return f"StructuredOutputsParams.{self.kind}: no compile thread came free within {QUEUE_WAIT_FACTOR * self.timeout_s:g} s; retry later"
        return None

    def sync(self, output_token_ids: list[int]) -> bool:
        """Replay the outputs the matcher has not seen; False (and `error`) if one breaks the grammar."""
        for token_id in output_token_ids[self.num_accepted :]:
            if not self.accept(token_id):
                return False
        return True

    def accept(self, token_id: int) -> bool:
        assert self.matcher is not None, "a request samples only once its grammar is ready"
        if not self.matcher.accept_token(token_id):
            self.error = f"output token {token_id} at position {self.num_accepted} is not allowed by the grammar"
            return False
        self.num_accepted += 1
        return True

    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_bitmask(bitmask, row)
