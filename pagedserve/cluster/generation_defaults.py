"""Sampling defaults from the model's generation_config.json, for the fields a request omits, as
`vllm serve --generation-config auto|vllm|FOLDER` does: "auto" reads the model's folder, "vllm"
reads nothing (SamplingParams' own defaults: temperature 1.0), a folder reads its file. The model
author's recommended sampling (SmolLM2: temperature 0.2, top_p 0.9) is what a request without
its own settings should get; OpenAI's 1.0 on a small model gives nonsense."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, Awaitable, Callable

logger = logging.getLogger(__name__)

# generation_config.json's keys that are request defaults (the same names in SamplingParams).
DEFAULT_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float}


def read_generation_defaults(folder: Path) -> dict[str, Any]:
    """The sampling defaults in `folder`/generation_config.json; {} when there is none. Values
    of the wrong type are skipped (a request never fails on the model's file)."""
    path = Path(folder) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        logger.warning("ignoring %s: %s", path, error)
        return {}
    defaults = {}
    for name, kind in DEFAULT_FIELDS.items():
        value = config.get(name) if isinstance(config, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or float(value).is_integer()):
            defaults[name] = kind(value)
    return defaults


class GenerationDefaults:
    """The served model's defaults, read once (in a thread) when first asked for."""

    def __init__(self, setting: str, model_folder: Callable[[], Awaitable[Path]]):
        """`setting`: "auto", "vllm" or a folder; `model_folder`: resolves the model's folder."""
        self.setting = setting
        self.model_folder = model_folder
        self._loading: asyncio.Task | None = None

    async def get(self) -> dict[str, Any]:
        if self.setting == "vllm":
            return {}
        if self._loading is None:
            self._loading = asyncio.ensure_future(self._load())
        return dict(await asyncio.shield(self._loading))

    async def _load(self) -> dict[str, Any]:
        try:
            folder = Path(self.setting).expanduser() if self.setting != "auto" else await self.model_folder()
            return await asyncio.to_thread(read_generation_defaults, folder)
        except Exception:
            logger.warning("cannot read the model's generation config; requests get SamplingParams' defaults", exc_info=True)
            return {}
