"""Where a reasoning model's thinking ends, in token ids: with `reasoning_parser` set, a request's
grammar applies only after it (vLLM's `is_reasoning_end` and `reasoning_ended`), so the
`<think>...</think>` part is free text and the answer after it follows the grammar.

The rule, as vLLM's qwen3 and deepseek_r1 parsers read it: the reasoning is over once the end
marker comes after the last start marker. In the prompt: a template that closes an empty think
block (Qwen3 with thinking off) has ended it; one that opens a block (DeepSeek-R1) has not, and
neither has a prompt with no marker at all (the model may open one). In the output: the first end
marker ends it, and the grammar starts with the next token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# reasoning_parser -> (start marker, end marker); both must be single tokens of the vocabulary
REASONING_MARKERS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": ("<think>", "</think>")}


@dataclass(frozen=True)
class ReasoningEnd:
    start_token_id: int
    end_token_id: int

    @classmethod
    def for_parser(cls, name: str, tokenizer: Any) -> ReasoningEnd:
        """ValueError when the tokenizer lacks either marker as one token."""
        ids = []
        for marker in REASONING_MARKERS[name]:
            token_id = tokenizer.convert_tokens_to_ids(marker)
            if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
                raise ValueError(f"reasoning_parser {name!r} needs {marker!r} as one token of the model's vocabulary; this tokenizer has none")
            ids.append(token_id)
        return cls(*ids)

    def grammar_start(self, prompt_token_ids: list[int], output_token_ids: list[int]) -> int | None:
        """How many output tokens precede the grammar (the reasoning, end marker included);
        None while the reasoning goes on."""
        if self._has_ended(prompt_token_ids):
            return 0
        if self.end_token_id in output_token_ids:
            return output_token_ids.index(self.end_token_id) + 1
        return None

    def _has_ended(self, token_ids: list[int]) -> bool:
        last_end = _last_index(token_ids, self.end_token_id)
        return last_end is not None and last_end > (_last_index(token_ids, self.start_token_id) or -1)


def _last_index(token_ids: list[int], token_id: int) -> int | None:
    for index in range(len(token_ids) - 1, -1, -1):
        if token_ids[index] == token_id:
            return index
    return None
