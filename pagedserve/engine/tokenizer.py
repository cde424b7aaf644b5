"""Loading a checkpoint's tokenizer (and its chat template) from a local folder."""

from __future__ import annotations

from typing import Any


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"cannot load a tokenizer from '{path}': {error}") from None
