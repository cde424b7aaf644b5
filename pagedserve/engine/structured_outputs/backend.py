"""What a grammar engine offers the manager: check a spec, compile it, and make matchers."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

import torch

from pagedserve.sampling_params import StructuredOutputsParams

# Compact JSON (disable_any_whitespace, the default) has no whitespace at all, not even after
# "," and ":", exactly as vLLM renders it: fewer tokens, and nothing a weak model can loop on.
COMPACT_SEPARATORS = (",", ":")

# Native threads of a batched bitmask fill. Rows are independent; more threads than cores would
# only contend with the step loop, hence the small cap.
BATCH_FILL_THREADS = max(1, min(4, os.cpu_count() or 1))


class GrammarMatcher(ABC):
    """One request's position in its grammar. Not thread-safe: only the engine loop uses it."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32, bit i of word i // 32)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""

    @classmethod
    def fill_rows(cls, matchers: list[GrammarMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """`matchers[i]` fills `bitmask[rows[i]]`, all in one call where the library has a batched
        fill (it then works in native threads, without a Python call per row)."""
        for matcher, row in zip(matchers, rows):
            matcher.fill_bitmask(bitmask, row)


class GrammarBackend(ABC):
    """One grammar library bound to the model's tokenizer and vocabulary (logit columns)."""

    name: str

    @staticmethod
    @abstractmethod
    def check(params: StructuredOutputsParams) -> None:
        """Raise ValueError naming the field and why if this backend cannot take the spec. Cheap
        (no tokenizer work), so it runs where a request enters."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (slow: runs in the manager's thread pool). Raises on a bad spec."""

    @abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (cheap: on the engine loop)."""
