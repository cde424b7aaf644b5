"""Sampling defaults from the model's generation_config.json (engine/generation_config.py), for the
fields a request omits, as `vllm serve --generation-config auto|vllm|FOLDER` does. The model
author's recommended sampling (SmolLM2: temperature 0.2, top_p 0.9) is what a request without
its own settings should get; OpenAI's 1.0 on a small model gives nonsense."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Awaitable, Callable

from pagedserve.engine.generation_config import read_generation_defaults

logger = logging.getLogger(__name__)


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
