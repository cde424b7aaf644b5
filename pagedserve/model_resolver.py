"""What a `model=` argument names, turned into a local Hugging Face checkpoint folder.

In order: a built-in name ('demo': SmolLM2-135M-Instruct; 'tiny': a random-weight test model),
a GGUF file (converted once into a folder under the cache), a local checkpoint folder, and a
model hub id ('org/name', downloaded or found in the local hub cache by huggingface_hub, as vLLM
does). Everything after this module sees only a folder with config.json and safetensors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from pagedserve.config import DEMO_MODEL, default_cache_dir

TINY_MODEL = "tiny"
BUILT_IN_MODELS = (DEMO_MODEL, TINY_MODEL)
# The files of a hub snapshot that loading needs: no PyTorch .bin, no other formats' weights.
HUB_FILE_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.jinja", "tokenizer*", "*.model", "*.txt"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ResolvedCheckpoint:
    model_path: Path
    tokenizer_path: Path


def resolve_checkpoint(model: str, tokenizer: str | None = None, revision: str | None = None) -> ResolvedCheckpoint:
    """The folders of the weights and of the tokenizer (`tokenizer=` overrides the model's)."""
    from pagedserve.gguf_checkpoint import gguf_has_tokenizer, gguf_source

    model_path = resolve_model_path(model, revision)
    if tokenizer:
        return ResolvedCheckpoint(model_path, resolve_model_path(tokenizer, revision, needs_weights=False))
    if not gguf_has_tokenizer(model_path):
        raise ValueError(
            f"GGUF file {gguf_source(model_path)} holds no tokenizer (no tokenizer.ggml.* metadata); "
            "pass tokenizer= a folder or hub id with the model's tokenizer"
        )
    return ResolvedCheckpoint(model_path, model_path)


def resolve_model_path(model: str, revision: str | None = None, needs_weights: bool = True) -> Path:
    """A local folder holding config.json (and safetensors weights when `needs_weights`)."""
    from pagedserve.gguf_checkpoint import converted_gguf, is_gguf_file

    if model == DEMO_MODEL:
        from pagedserve.demo import ensure_demo_model

        return ensure_demo_model()
    if model == TINY_MODEL:
        from pagedserve.tiny_model import ensure_tiny_model

        return ensure_tiny_model()
    path = Path(model).expanduser()
    if is_gguf_file(path):
        return converted_gguf(path, default_cache_dir())
    if path.is_dir():
        return check_checkpoint_folder(path, needs_weights)
    if _HUB_ID.match(model) and not model.startswith((".", "~")):
        return check_checkpoint_folder(download_from_hub(model, revision), needs_weights)
    raise FileNotFoundError(
        f"model '{model}' is neither a local folder, a .gguf file, a model hub id ('org/name') nor a "
        f"built-in model ('{DEMO_MODEL}': SmolLM2-135M-Instruct, '{TINY_MODEL}': a random-weight test model)"
    )


def check_checkpoint_folder(path: Path, needs_weights: bool = True) -> Path:
    """A folder only for its tokenizer needs nothing more; a model's needs config and weights."""
    if not needs_weights:
        return path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder '{path}' has no config.json")
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"model folder '{path}' has no *.safetensors weights "
            "(PyTorch .bin checkpoints are not supported; a .gguf file is)"
        )
    return path


def download_from_hub(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder of a hub model: downloaded (HF_TOKEN, HF_HOME, HF_HUB_CACHE honoured)
    or, with HF_HUB_OFFLINE=1, taken from the local hub cache."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=hub_cache_dir(),
            allow_patterns=HUB_FILE_PATTERNS,
            local_files_only=offline,
            token=os.environ.get("HF_TOKEN") or None,
        )
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        where = "offline (HF_HUB_OFFLINE=1) and the local hub cache" if offline else "the model hub or the local hub cache"
        raise FileNotFoundError(
            f"model '{repo_id}' (revision {revision or 'main'}) is not available from {where} "
            f"({hub_cache_dir() or 'the default hub cache'}): {type(error).__name__}: {error}. "
            f"Get it with `huggingface-cli download {repo_id}` where the hub is reachable (set HF_TOKEN "
            "for gated models) and copy the cache here (HF_HOME), or pass a local folder or a .gguf file"
        ) from None
    return Path(folder)


def hub_cache_dir() -> str | None:
    """Read from the environment at call time (huggingface_hub reads it once at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return str(Path(os.environ["HF_HOME"]) / "hub")
    return None
