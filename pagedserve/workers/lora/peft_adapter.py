"""A PEFT LoRA adapter folder (`adapter_config.json` + `adapter_model.safetensors`), read and
checked against what pagedserve serves. Checked where a request names the adapter (the front
end: `check_adapter`), read on each rank (`read_adapter`).

Served: LoRA on q/k/v/o and gate/up/down, of any rank up to `max_lora_rank`, scaled by
`lora_alpha / r` (or `lora_alpha / sqrt(r)` with `use_rslora`), per-module ranks and alphas
(`rank_pattern`, `alpha_pattern`). Refused, naming the field: anything that changes more than
these projections (`modules_to_save`, biases, DoRA, other targets)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = (*ATTENTION_TARGETS, "gate_proj", "up_proj", "down_proj")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight -> (3, "q_proj", "A")
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class AdapterSpec:
    """What the config says: each target's rank and scale."""

    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]

    def scale(self, module: str) -> float:
        rank = self._pattern(self.rank_pattern, module, self.rank)
        alpha = self._pattern(self.alpha_pattern, module, self.alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @staticmethod
    def _pattern(pattern: dict[str, Any], module: str, default: Any) -> Any:
        for key, value in pattern.items():  # as PEFT matches a pattern key against a module's name
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default


def check_adapter(path: str, max_lora_rank: int) -> AdapterSpec:
    """The adapter's spec; ValueError naming the field when pagedserve cannot serve it exactly."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"lora_path: {folder} has no {CONFIG_FILE} (a PEFT LoRA adapter folder is needed)")
    if not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"lora_path: {folder} has no {WEIGHTS_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as error:
        raise ValueError(f"lora_path: {config_path} is not JSON: {error}") from None
    _refuse_unserved(config)
    spec = AdapterSpec(
        folder, int(config.get("r", 8)), float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False)),
        dict(config.get("rank_pattern") or {}), dict(config.get("alpha_pattern") or {}),
    )
    largest = max([spec.rank, *spec.rank_pattern.values()])
    if largest > max_lora_rank:
        raise ValueError(f"adapter rank r={largest} exceeds max_lora_rank={max_lora_rank}; start the engine with a larger max_lora_rank")
    return spec


def _refuse_unserved(config: dict[str, Any]) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type {config.get('peft_type')!r} is not served: only LORA adapters are")
    if config.get("modules_to_save"):
        raise ValueError(f"modules_to_save {config['modules_to_save']} is not served: an adapter may change only {', '.join(TARGETS)}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"bias {config['bias']!r} is not served: only bias 'none'")
    if config.get("use_dora"):
        raise ValueError("use_dora is not served (DoRA)")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = [t for t in targets if t.split(".")[-1] not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"target_modules {unknown or targets} are not served; allowed: {', '.join(TARGETS)}")


def read_adapter(spec: AdapterSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer index, projection) -> (A [r, in], B [out, r] times the module's scale), float32."""
    from safetensors.torch import load_file

    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(spec.path / WEIGHTS_FILE)).items():
        match = _KEY.match(key)
        if match is None or match.group(2) not in TARGETS:
            raise ValueError(f"{WEIGHTS_FILE} holds {key!r}, which is not a LoRA weight of {', '.join(TARGETS)}")
        halves.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor.float()
    weights = {}
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{WEIGHTS_FILE}: layer {layer} {module} has lora_{''.join(pair)} only")
        block = "self_attn" if module in ATTENTION_TARGETS else "mlp"
        weights[(layer, module)] = (pair["A"], pair["B"] * spec.scale(f"model.layers.{layer}.{block}.{module}"))
    return weights
