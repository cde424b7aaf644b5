"""Loading a checkpoint's tokenizer (and its chat template) from a local folder, or from a GGUF
file's metadata (`gguf_file`: a file name inside `path`; no weights are read), and the longest
text a request may hand it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def load_tokenizer(path: str, gguf_file: str | None = None) -> Any:
    from transformers import AutoTokenizer

    try:
        if gguf_file is not None:
            return AutoTokenizer.from_pretrained(path, gguf_file=gguf_file, local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        where = f"{path}/{gguf_file}" if gguf_file else path
        raise ValueError(f"cannot load a tokenizer from '{where}': {error}") from None


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the tokenizer's longest vocabulary entry, added tokens included. No token
    stands for more characters of a text than its entry spells (a byte-level entry has one
    character per byte), so text longer than max_model_len x this cannot fit in max_model_len
    tokens. Computed once per tokenizer (a pass over the vocabulary)."""
    return max((len(entry) for entry in tokenizer.get_vocab()), default=1)


@dataclass(frozen=True)
class TextLimit:
    """The longest text worth encoding: encoding costs about 0.5 s per MB, so a text that
    cannot fit is refused before it is encoded (issue 19)."""

    max_model_len: int
    longest_token_chars: int

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int) -> TextLimit:
        return cls(max_model_len, longest_token_chars(tokenizer))

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.longest_token_chars

    def check(self, num_chars: int, field: str) -> None:
        """ValueError, naming `field` and the limit, for text too long to fit in max_model_len."""
        if num_chars > self.max_chars:
            raise ValueError(
                f"{field}: {num_chars} characters, more than the {self.max_chars} that can fit in "
                f"max_model_len={self.max_model_len} tokens (at most {self.longest_token_chars} characters per token, "
                "the tokenizer's longest entry)"
            )


def num_message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of a conversation's text fields: the rendered prompt holds them all and more."""
    return sum(len(value) for message in messages for value in message.values() if isinstance(value, str))
