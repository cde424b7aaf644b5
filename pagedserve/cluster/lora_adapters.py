"""Adapters loaded while the server runs (vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter), in the ingress.

No request may make the server read an arbitrary path: loading is off unless the operator named
folders (`lora_dirs`), a path with a `..` part is refused as given, and the path, its symlinks
followed, must lie inside one of those folders. The routes sit behind the API key like every
route but the probes (request_gate.py). The adapter's own files are then checked by an engine
replica, which reads them from the same volume as it will when a request names the adapter.

Loaded adapters live in the ingress's memory: a restarted ingress serves those `lora_modules`
names again, not the ones loaded at runtime (as vLLM's API server forgets them)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.lora_request import MAX_LORA_NAME_CHARS


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_CHARS)


def allowed_adapter_path(path: str, lora_dirs: list[str]) -> str:
    """The adapter folder's real path; ValueError unless it lies inside one of `lora_dirs`."""
    if not lora_dirs:
        raise ValueError("loading adapters at runtime is off: start the server with --lora-dirs DIR (the folders adapters may come from)")
    if ".." in Path(path).parts:
        raise ValueError("lora_path must not contain '..'")
    real = os.path.realpath(path)
    roots = [os.path.realpath(folder) for folder in lora_dirs]
    if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots):
        raise ValueError(f"lora_path must lie inside one of the server's lora_dirs ({', '.join(lora_dirs)})")
    return real
