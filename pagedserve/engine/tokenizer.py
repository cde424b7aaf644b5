"""Loading a checkpoint's tokenizer (and its chat template) from a local folder, or from a GGUF
file's metadata (`gguf_file`: a file name inside `path`; no weights are read)."""

from __future__ import annotations

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
