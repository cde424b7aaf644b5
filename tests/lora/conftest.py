"""LoRA test adapters, made with PEFT on the tiny test models, and their reference: PEFT's merged
model (`merge_and_unload`) in Hugging Face, greedy, float32.

PEFT initialises B to zero, so a fresh adapter changes nothing and a test would prove nothing:
every adapter here gets random non-zero A and B, scaled so the adapter changes the greedy tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pagedserve import LoRARequest
from tests.models import HFReference

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (LoraConfig arguments, seed): different ranks, targets and scalings
ADAPTERS = {
    "all8": ({"r": 8, "lora_alpha": 16, "target_modules": ALL_LINEAR}, 1),
    "qv4": ({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "use_rslora": True}, 2),
    "mlp2": ({"r": 2, "lora_alpha": 4, "target_modules": ["gate_proj", "down_proj"]}, 3),
}


def build_adapter(base_dir: Path, folder: Path, config: dict, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(**config))
    generator = torch.Generator().manual_seed(seed)
    for name, param in peft_model.named_parameters():
        if "lora_A" in name or "lora_B" in name:
            param.data = torch.randn(param.shape, generator=generator) * 0.2
    peft_model.save_pretrained(str(folder))
    return folder


class MergedReference(HFReference):
    """HF greedy on the base model with the adapter merged in by PEFT."""

    def __init__(self, base_dir: Path, adapter_dir: Path):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        self.model = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload().eval()
        self.cache = {}


@pytest.fixture(scope="session")
def lora_adapters(model_dirs, artifacts) -> dict[str, dict[str, Path]]:
    """arch -> adapter name -> PEFT folder, for the llama and qwen2 tiny models."""
    adapters: dict[str, dict[str, Path]] = {}
    for arch in ("llama", "qwen2"):
        adapters[arch] = {}
        for name, (config, seed) in ADAPTERS.items():
            folder = artifacts / "lora" / arch / name
            if folder.exists():
                shutil.rmtree(folder)
            adapters[arch][name] = build_adapter(model_dirs[arch], folder, config, seed)
    return adapters


@pytest.fixture(scope="session")
def lora_references(model_dirs, lora_adapters) -> dict[tuple[str, str], HFReference]:
    """(arch, adapter name or None) -> the merged model's reference (None: the base model)."""
    references: dict[tuple[str, str | None], HFReference] = {}
    for arch, adapters in lora_adapters.items():
        references[(arch, None)] = HFReference(model_dirs[arch])
        for name, folder in adapters.items():
            references[(arch, name)] = MergedReference(model_dirs[arch], folder)
    return references


def lora_request(adapters: dict[str, Path], name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, list(ADAPTERS).index(name) + 1, str(adapters[name]))
