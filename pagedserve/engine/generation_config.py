"""The model author's sampling defaults, from the model's generation_config.json, as vLLM's
`--generation-config auto|vllm|FOLDER` reads them: "auto" reads the model's folder, "vllm" reads
nothing (SamplingParams' own defaults: temperature 1.0), a folder reads its file. The server
applies them to the fields a request omits (cluster/generation_defaults.py); the offline LLM to a
`generate` call given no SamplingParams (vLLM's `LLM.get_default_sampling_params`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

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


def generation_defaults(setting: str, model_path: str) -> dict[str, Any]:
    """The defaults `setting` ("auto", "vllm" or a folder) gives for the model at `model_path`."""
    if setting == "vllm":
        return {}
    return read_generation_defaults(Path(model_path) if setting == "auto" else Path(setting).expanduser())
