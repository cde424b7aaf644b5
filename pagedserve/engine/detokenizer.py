"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level BPE (a character may span tokens) and for
tokenizers whose leading spaces depend on the previous token. So each new token is decoded
together with a few tokens before it (`prefix_offset..read_offset`), and only text past that
window's own decoding is new. Text ending in U+FFFD is an incomplete character: it waits for the
next token, so half a character is never emitted.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from pagedserve.sampling_params import SamplingParams

# Prompt tokens decoded alongside the first outputs, so their leading spaces come out right.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


def backend_decode(tokenizer: Any) -> Callable[..., str]:
    """The tokenizer's decode: the Rust tokenizer's own where transformers' `decode` would return
    exactly its text (a fast tokenizer whose decode is not overridden and that cleans up no
    spaces), else transformers'. Its wrapper converts the ids and dispatches on every call: 3.3
    against 1.1 us a call here, two calls a token; the detokenizer's 3.1 ms a step at 256 running
    requests became 2.1 (`benchmarks/engine_step_cpu.py`)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its decode as it is
        return tokenizer.decode
    cls = type(tokenizer)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    )
    return tokenizer._tokenizer.decode if plain else tokenizer.decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, vocab_size: int, prompt_token_ids: list[int], params: SamplingParams):
        self.decode = backend_decode(tokenizer)
        self.vocab_size = vocab_size  # ids at or past this (embedding padding) decode to nothing
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.stop_matcher = StopMatcher(params.stop) if params.stop else None
        self.include_stop = params.include_stop_str_in_output
        self.stop_buffer_length = params.stop_buffer_length
        context = [t for t in prompt_token_ids[-INITIAL_CONTEXT_TOKENS:] if t < vocab_size]
        self.token_ids = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""
        self.num_sent_chars = 0  # how much of output_text the last delta reached

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Decode new tokens; returns the stop string that ends the request, if one appeared.
        `stop_terminated`: the last token is an EOS or stop token id; it is not shown unless
        include_stop_str_in_output is set."""
        if stop_terminated and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        start = len(self.output_text)
        for token_id in new_token_ids:
            if 0 <= token_id < self.vocab_size:
                self.token_ids.append(token_id)
                self._decode_last()
        return self._find_stop_string(start) if self.stop_matcher is not None else None

    def replay(self, token_ids: list[int], num_sent_chars: int) -> None:
        """Rebuild the state after `token_ids` (a resumed request's earlier outputs) of which
        the client saw the first `num_sent_chars` characters: the same text, offsets and
        stop-string window an undisturbed run would have now."""
        if self.update(token_ids, stop_terminated=False) is not None:
            raise ValueError("the resumed outputs already contain a stop string: that request had finished")
        if num_sent_chars > len(self.output_text):
            raise ValueError(f"num_sent_chars={num_sent_chars} is more than the {len(self.output_text)} characters the resumed outputs decode to")
        self.num_sent_chars = num_sent_chars

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show now. While running, the last `stop_buffer_length` characters are held
        back: they may be the start of a stop string that must not be shown."""
        length = len(self.output_text) if finished else len(self.output_text) - self.stop_buffer_length
        # Clamp: text shorter than the held-back length would give a negative slice end, which
        # counts from the end and would show the start of a possible stop string.
        length = max(length, 0)
        if not delta:
            return self.output_text[:length]
        if length <= self.num_sent_chars:
            return ""
        text = self.output_text[self.num_sent_chars : length]
        self.num_sent_chars = length
        return text

    def _decode_last(self) -> None:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self.output_text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _find_stop_string(self, new_text_start: int) -> str | None:
        """The earliest stop string that overlaps the new text; truncates the output there."""
        found = self.stop_matcher.find(self.output_text, new_text_start)
        if found is None:
            return None
        index, stop = found
        self.output_text = self.output_text[: index + len(stop) if self.include_stop else index]
        return stop


class StopMatcher:
    """All of a request's stop strings found in one pass over the new text and the characters
    before it that a stop string could straddle (the longest one's length - 1): a step's cost
    depends on its new text and the stop strings, never on the text generated so far.

    Semantics (as a `str.find` per stop string): among the stop strings that end in the new
    text, the one that starts earliest wins; of those starting at the same place, the first listed.
    """

    def __init__(self, stop: list[str]):
        self.stop = list(stop)
        self.overlap = max(len(s) for s in stop) - 1
        # re's alternation tries alternatives in order at each position, from the leftmost one:
        # the earliest match, ties to the first listed.
        self.pattern = re.compile("|".join(re.escape(s) for s in stop))
        self.num_scanned_chars = 0  # characters searched so far, for tests of the bound above

    def find(self, text: str, new_text_start: int) -> tuple[int, str] | None:
        """The stop string that ends past `new_text_start` and starts earliest, with its index."""
        pos = max(0, new_text_start - self.overlap)
        self.num_scanned_chars += len(text) - pos
        while (match := self.pattern.search(text, pos)) is not None:
            index = match.start()
            # The first listed that starts here and ends in the new text (one ending before it
            # was already looked for in an earlier step).
            for stop in self.stop:
                if index + len(stop) > new_text_start and text.startswith(stop, index):
                    return index, stop
            pos = index + 1
        return None
