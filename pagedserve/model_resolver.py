"""What a `model=` argument names, turned into a local Hugging Face checkpoint folder, and the
`ModelConfig` the engine derives from that folder's config.json (resolve_model_config).

In order: a built-in name ('demo': SmolLM2-135M-Instruct; 'tiny': a random-weight test model),
a GGUF file (converted once into a folder under the cache), a local checkpoint folder, and a
model hub id ('org/name', downloaded or found in the local hub cache by huggingface_hub, as vLLM
does). Everything after this module sees only a folder with config.json and safetensors.

The engine calls this once per engine; the workers only receive the finished ModelConfig.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from pagedserve.config import DEMO_MODEL, EngineConfig, ModelConfig, default_cache_dir

TINY_MODEL = "tiny"
BUILT_IN_MODELS = (DEMO_MODEL, TINY_MODEL)
# The files of a hub snapshot that loading needs: no PyTorch .bin, no other formats' weights.
HUB_FILE_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.jinja", "tokenizer*", "*.model", "*.txt"]
# The files a tokenizer (and its chat template) needs: no weights.
TOKENIZER_FILE_PATTERNS = ["*.json", "*.jinja", "tokenizer*", "*.model", "*.txt"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# EngineConfig.dtype's names and a checkpoint's torch_dtype strings.
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ResolvedCheckpoint:
    model_path: Path
    tokenizer_path: Path


@dataclass(frozen=True)
class TokenizerSource:
    """Where a tokenizer loads from without any weights: a folder, or a GGUF file's metadata
    (`gguf_file`, a file name inside `folder`)."""

    folder: Path
    gguf_file: str | None = None


def resolve_tokenizer_source(model: str, tokenizer: str | None = None, revision: str | None = None) -> TokenizerSource:
    """The tokenizer of `model=` (or of `tokenizer=`) for a process that runs no model (the
    ingress): never a weight download, never a GGUF conversion (which dequantizes the whole model,
    about 28 GB for a 7B one)."""
    from pagedserve.gguf_checkpoint import gguf_file_has_tokenizer, is_gguf_file

    name = tokenizer or model
    if name == DEMO_MODEL:
        from pagedserve.demo import ensure_demo_gguf

        gguf_path = ensure_demo_gguf()
        return TokenizerSource(gguf_path.parent, gguf_path.name)
    if name == TINY_MODEL:
        from pagedserve.tiny_model import ensure_tiny_model

        return TokenizerSource(ensure_tiny_model())
    path = Path(name).expanduser()
    if is_gguf_file(path):
        path = path.resolve()
        if not gguf_file_has_tokenizer(path):
            raise ValueError(
                f"GGUF file {path} holds no tokenizer (no tokenizer.ggml.* metadata); "
                "pass tokenizer= a folder or hub id with the model's tokenizer"
            )
        return TokenizerSource(path.parent, path.name)
    return TokenizerSource(resolve_model_path(name, revision, needs_weights=False))


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
        patterns = HUB_FILE_PATTERNS if needs_weights else TOKENIZER_FILE_PATTERNS
        return check_checkpoint_folder(download_from_hub(model, revision, patterns), needs_weights)
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


def download_from_hub(repo_id: str, revision: str | None = None, patterns: list[str] = HUB_FILE_PATTERNS) -> Path:
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
            allow_patterns=patterns,
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


# ---- config.json -> ModelConfig ---------------------------------------------------------------


def resolve_model_config(config: EngineConfig, device_resolver: Callable[[EngineConfig], str]) -> ModelConfig:
    """Check the checkpoint folder (cheaply, before any weights load) and derive the model's shape.
    `device_resolver` (the executor's `resolve_device`: only the executor knows where the ranks
    run) picks the device once the checkpoint checks pass, so a bad folder fails before anything
    starts. Nothing here starts Ray or any other process (the Ray executor's resolver may)."""
    checkpoint = resolve_checkpoint(config.model, config.tokenizer, config.revision)
    model_path, tokenizer_path = checkpoint.model_path, checkpoint.tokenizer_path
    hf_config = SimpleNamespace(**_load_hf_config(model_path).to_dict())
    architecture = _architecture_of(hf_config, model_path)
    device = device_resolver(config)
    from pagedserve.workers.models.llama import attention_dims

    num_heads, num_kv_heads, head_dim = attention_dims(hf_config)
    return ModelConfig(
        model_path=str(model_path),
        tokenizer_path=str(tokenizer_path),
        architecture=architecture,
        hf_config=hf_config,
        dtype=_resolve_dtype(config.dtype, hf_config, device),
        device=device,
        max_model_len=_resolve_max_model_len(config.max_model_len, hf_config),
        vocab_size=hf_config.vocab_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        eos_token_ids=_eos_token_ids(model_path, hf_config),
    )


def _load_hf_config(path: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, KeyError, OSError) as error:
        raise ValueError(f"cannot read {path / 'config.json'}: {error}") from None


def _architecture_of(hf_config: Any, path: Path) -> str:
    # The workers' model registry is the one list of what can be built: asked here, before any
    # worker starts, so an unsupported checkpoint fails with its name.
    from pagedserve.workers.models.registry import MODEL_CLASSES

    architectures = getattr(hf_config, "architectures", None) or []
    for name in architectures:
        if name in MODEL_CLASSES:
            return name
    raise ValueError(
        f"unsupported architecture {architectures or '(none given)'} in {path / 'config.json'}; "
        f"supported: {', '.join(MODEL_CLASSES)}"
    )


def _resolve_dtype(dtype: str, hf_config: Any, device: str) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    checkpoint = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = _DTYPES.get(checkpoint, torch.float32)
    if device == "cpu":
        # A half-precision checkpoint runs in bfloat16 where the CPU computes it natively (vLLM's
        # choice there): float32 would double the memory traffic for precision its weights never
        # had. A float32 checkpoint keeps its precision, and a CPU without bfloat16 instructions
        # (where torch emulates it, slowly) stays float32.
        if checkpoint in (torch.bfloat16, torch.float16) and cpu_has_native_bfloat16():
            return torch.bfloat16
        return torch.float32
    # A float32 checkpoint on a GPU runs in bfloat16, as vLLM does: float32 halves throughput.
    # GPUs before Ampere have no bfloat16 arithmetic (torch only emulates it): they get float16.
    if checkpoint in (None, torch.float32, torch.bfloat16):
        return torch.bfloat16 if _gpu_supports_bfloat16() else torch.float16
    return checkpoint


@functools.cache
def cpu_has_native_bfloat16() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX-512 BF16 or AMX), read from /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _gpu_supports_bfloat16() -> bool:
    """Asked of this process's GPU. An engine without one (its Ray workers hold the GPUs) cannot
    ask, and assumes Ampere or newer."""
    if not torch.cuda.is_available():
        return True
    return torch.cuda.is_bf16_supported(including_emulation=False)


def _resolve_max_model_len(requested: int | None, hf_config: Any) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True):
        # Sliding-window attention is not implemented: cap the length where it makes no difference.
        limit = min(limit, window)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds what the model supports ({limit}, from "
            "max_position_embeddings or sliding_window in config.json)"
        )
    return requested


def _eos_token_ids(path: Path, hf_config: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json (which may list several) and config.json."""
    ids: list[int] = []
    generation = path / "generation_config.json"
    for source in (json.loads(generation.read_text()) if generation.is_file() else {}, hf_config):
        value = source.get("eos_token_id") if isinstance(source, dict) else getattr(source, "eos_token_id", None)
        for token_id in value if isinstance(value, list) else [value]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return tuple(ids)
