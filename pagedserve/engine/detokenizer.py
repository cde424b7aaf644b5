"""Incremental detokenization with stop strings.

Decoding token by token is wrong for byte-level BPE (a character may span tokens) and for
tokenizers whose leading spaces depend on the previous token. So each new token is decoded
together with a few tokens before it (`prefix_offset..read_offset`), and only text past that
window's own decoding is new. Text ending in U+FFFD is an incomplete character: it waits for the
next token, so half a character is never emitted.
"""

from __future__ import annotations

from typing import Any

from pagedserve.sampling_params import SamplingParams

# Prompt tokens decoded alongside the first outputs, so their leading spaces come out right.
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, vocab_size: int, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # ids at or past this (embedding padding) decode to nothing
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
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
        return self._find_stop_string(start) if self.stop else None

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
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _find_stop_string(self, new_text_start: int) -> str | None:
        """The earliest stop string that overlaps the new text; truncates the output there."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, max(0, new_text_start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[: index + len(stop) if self.include_stop else index]
        return stop
