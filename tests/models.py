"""Tiny random-weight checkpoints of each supported architecture, and Hugging Face references.

Weights are drawn with a larger spread than real initialisations (std 0.2) so greedy choices have
clear margins: float32 rounding differences between two correct implementations then never flip
an argmax, and a real bug still changes tokens at once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_VOCAB = 512

# name -> (HF config class name, config overrides)
MODEL_SPECS: dict[str, tuple[str, dict]] = {
    # GQA (4 query heads share 2 KV heads), llama3 RoPE scaling.
    "llama": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64,
            ),
        ),
    ),
    # MQA (one KV head), linear RoPE scaling, an explicit head_dim unlike hidden/heads.
    "mistral": (
        "MistralConfig",
        dict(
            num_attention_heads=4, num_key_value_heads=1, head_dim=24, sliding_window=None,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
        ),
    ),
    # QKV bias, tied embeddings, an embedding padded past the tokenizer's vocabulary.
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, vocab_size=576)),
    # Per-head q/k RMSNorm, explicit head_dim.
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
}


def hf_config(name: str, tokenizer, **overrides):
    import transformers

    class_name, spec = MODEL_SPECS[name]
    params = dict(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    params.update(spec)
    params.update(overrides)
    config = getattr(transformers, class_name)(**params)
    config.architectures = [class_name.replace("Config", "ForCausalLM")]
    return config


def build_model(folder: Path, name: str, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight HF checkpoint (float32, safetensors) plus the test tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = hf_config(name, tokenizer, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, folder / item.name)
    return folder


class HFReference:
    """Greedy completions from Hugging Face transformers, cached per (prompt, max_tokens)."""

    def __init__(self, folder: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        self.cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    @torch.inference_mode()
    def greedy(self, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        key = (tuple(prompt_token_ids), max_tokens)
        if key not in self.cache:
            input_ids = torch.tensor([prompt_token_ids])
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.model.config.pad_token_id,
            )
            self.cache[key] = out[0, len(prompt_token_ids):].tolist()
        return self.cache[key]
