"""Build a model for this rank and fill it from a Hugging Face safetensors checkpoint.

Each tensor is opened lazily (`safe_open(...).get_slice`), and a parameter's weight loader reads
only the rows or columns of its shard; tensors of layers on other pipeline stages are never read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.kernels import AttentionBackend
from pagedserve.workers.compile import compile_model, should_compile
from pagedserve.workers.layers import cpu_gemm
from pagedserve.workers.models.registry import model_class
from pagedserve.workers.parallel_state import ParallelContext


def load_model(
    model_config: ModelConfig,
    parallel: ParallelContext,
    backend: AttentionBackend,
    device: torch.device,
    engine_config: EngineConfig | None = None,
) -> nn.Module:
    """This rank's model, loaded and, where `engine_config` asks for it, compiled (workers/compile.py)."""
    cls = model_class(model_config.architecture)
    with torch.device(device), _default_dtype(model_config.dtype):
        model = cls(model_config.hf_config, model_config.architecture, parallel, backend, model_config.max_model_len)
    loaded = model.load_weights(iterate_checkpoint(Path(model_config.model_path)))
    missing = sorted(set(dict(model.named_parameters())) - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {model_config.model_path} lacks weights for {shown}")
    model.eval()
    compiling = engine_config is not None and should_compile(engine_config, device, parallel)
    cpu_gemm.pack_model(model, exclude=model.model if compiling else None)  # a no-op off the CPU
    if compiling:
        compile_model(model)
    return model


def iterate_checkpoint(folder: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) for every tensor in the checkpoint's safetensors files."""
    for path in checkpoint_files(folder):
        try:
            handle = safe_open(str(path), framework="pt")
            names = list(handle.keys())
        except Exception as error:  # safetensors has its own error types for corrupt files
            raise ValueError(f"cannot read weights from {path}: {error}") from error
        for name in names:
            yield name, _NamedSlice(handle.get_slice(name), f"{name} in {path}")


class _NamedSlice:
    """A lazy checkpoint tensor whose read errors say which tensor of which file failed."""

    def __init__(self, tensor: Any, where: str):
        self.tensor, self.where = tensor, where

    def __getitem__(self, index: Any) -> torch.Tensor:
        try:
            return self.tensor[index]
        except Exception as error:
            raise ValueError(f"cannot read {self.where}: {error}") from error


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / name for name in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that do not exist: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder '{folder}' has no *.safetensors weights")
    return files


class _default_dtype:
    """Parameters are created directly in the target dtype (no float32 copy of the whole model)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def __enter__(self) -> None:
        self.previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc: object) -> None:
        torch.set_default_dtype(self.previous)
