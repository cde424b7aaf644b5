"""GGUF files, turned once into a Hugging Face safetensors folder that loads like any other.

A GGUF file holds the architecture, the config, the tokenizer and the chat template as metadata,
and weights that are often quantized. transformers' GGUF support (the `gguf` package) reads all of
it and dequantizes the weights to float32; we save that as a Hugging Face folder under the cache,
keyed by the file's path, size and modification time. Loading then stays on the normal path: each
rank reads only its own shard of the safetensors, and later starts skip the conversion.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# GGUF `general.architecture` -> the architecture our model registry builds. Mistral GGUFs are
# written as "llama", so a mistral entry is there only for files that say so.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Tensor types the `gguf` package dequantizes (and that the tests cover: F32, F16, BF16, Q8_0,
# Q4_0, Q4_1; the others go through the same `gguf.quants.dequantize`).
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Written last into a converted folder: its presence means the folder is complete.
SOURCE_FILE = "gguf_source.json"
CONVERSION_VERSION = 1


def is_gguf_file(model: str | Path) -> bool:
    path = Path(model).expanduser()
    return path.suffix.lower() == ".gguf" or (path.is_file() and _has_gguf_magic(path))


def converted_gguf(path: Path, cache_dir: Path) -> Path:
    """The Hugging Face folder of a GGUF file, converted on first use. The conversion holds the
    whole model in float32 (about 28 GB for a 7B model), so it runs once per file: the replicas
    and engines of a node that start together wait on a file lock for the first to finish, then
    find its folder (which lands by an atomic rename: never half written)."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file '{path}' does not exist")
    target = cache_dir / "gguf" / f"{path.stem}-{_file_key(path)}"
    if (target / SOURCE_FILE).is_file():
        return target
    check_gguf(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when its holder dies
        if not (target / SOURCE_FILE).is_file():
            _convert_into(path, target)
    return target


def _convert_into(path: Path, target: Path) -> None:
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        convert_gguf(path, staging)
        shutil.rmtree(target, ignore_errors=True)  # a folder left without SOURCE_FILE is incomplete
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def gguf_file_has_tokenizer(path: Path) -> bool:
    """Whether a GGUF file carries its tokenizer in its metadata (read without its tensors)."""
    return _reader(path).fields.get("tokenizer.ggml.tokens") is not None


def gguf_has_tokenizer(folder: Path) -> bool:
    """Whether a converted folder holds the GGUF file's tokenizer (False for any other folder
    with no tokenizer files either)."""
    source = folder / SOURCE_FILE
    if source.is_file():
        return bool(json.loads(source.read_text())["has_tokenizer"])
    return True


def gguf_source(folder: Path) -> str | None:
    """The GGUF file a converted folder came from, or None for an ordinary checkpoint folder."""
    source = folder / SOURCE_FILE
    return json.loads(source.read_text())["source"] if source.is_file() else None


def check_gguf(path: Path) -> None:
    """Refuse, before the slow part, an architecture or a tensor type we cannot run."""
    reader = _reader(path)
    architecture = _field(reader, "general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF file {path} holds an unsupported architecture '{architecture}'; "
            f"supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    kinds = sorted({tensor.tensor_type.name for tensor in reader.tensors} - set(GGUF_TENSOR_TYPES))
    if kinds:
        raise ValueError(
            f"GGUF file {path} holds tensors of unsupported quantization type {', '.join(kinds)}; "
            f"supported: {', '.join(GGUF_TENSOR_TYPES)}"
        )


def convert_gguf(path: Path, folder: Path) -> None:
    """Dequantize a GGUF file to float32 and save it as a Hugging Face folder (config with
    `architectures`, safetensors weights, tokenizer and chat template when the file has them)."""
    import torch
    from transformers import AutoModelForCausalLM

    architecture = GGUF_ARCHITECTURES[_field(_reader(path), "general.architecture")]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    _save_hf_folder(model, architecture, folder)
    has_tokenizer = gguf_file_has_tokenizer(path)
    if has_tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(folder))
    source = {"source": str(path), "has_tokenizer": has_tokenizer, "version": CONVERSION_VERSION}
    (folder / SOURCE_FILE).write_text(json.dumps(source, indent=2))


def _save_hf_folder(model, architecture: str, folder: Path) -> None:
    """transformers refuses `save_pretrained` on a model loaded from GGUF, so save its parts."""
    from safetensors.torch import save_file

    config = model.config
    config.architectures = [architecture]  # transformers' GGUF config has none
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized now
    tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # the embedding matrix is the head
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(folder))
    model.generation_config.save_pretrained(str(folder))


def _file_key(path: Path) -> str:
    stat = path.stat()
    text = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERSION_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as error:  # the reader raises ValueError, struct errors, ... on bad files
        raise ValueError(f"cannot read GGUF file {path}: {error}") from None


def _field(reader, name: str):
    field = reader.fields.get(name)
    return None if field is None else field.contents()


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(4) == b"GGUF"
