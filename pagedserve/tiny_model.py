"""The built-in 'tiny' model: a small random-weight Llama checkpoint and a byte-level BPE tokenizer.

`LLM(model="tiny")` builds it once under the cache folder, in Hugging Face format, and then loads
it through the same code as any other checkpoint. No network is touched. The weights come from a
seeded torch generator in a fixed order, so every machine builds the same model. It answers with
noise: it is for tests and quick runs ('demo' is the real, trained model).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

TINY_VERSION = "v1"
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)


def ensure_tiny_model(cache_dir: Path | None = None) -> Path:
    """The tiny checkpoint's folder, built on first use (atomically: concurrent builders are safe)."""
    from pagedserve.config import default_cache_dir

    target = (cache_dir or default_cache_dir()) / f"tiny-{TINY_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        build_tiny_model(staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # not merely lost a race to another builder
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tiny_model(folder: Path) -> None:
    tokenizer = build_tokenizer(folder)
    vocab_size = _round_up(len(tokenizer), 64)  # padded, as real checkpoints often are
    config = _llama_config(vocab_size, tokenizer)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    eos = {"eos_token_id": config["eos_token_id"], "bos_token_id": config["bos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(eos, indent=2))
    _save_random_weights(folder / "model.safetensors", config, seed=0)


def build_tokenizer(folder: Path, vocab_size: int = 512, corpus: str | None = None):
    """Train a byte-level BPE tokenizer on local text and save it in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = corpus if corpus is not None else (Path(__file__).parent / "data" / "corpus.txt").read_text()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(text.splitlines(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def _llama_config(vocab_size: int, tokenizer) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|end|>"),
        "pad_token_id": tokenizer.pad_token_id,
        "dtype": "float32",
        **TINY_SHAPE,
    }


def _save_random_weights(path: Path, config: dict, seed: int) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.05

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": (hidden, hidden),
            "self_attn.k_proj": (kv, hidden),
            "self_attn.v_proj": (kv, hidden),
            "self_attn.o_proj": (hidden, hidden),
            "mlp.gate_proj": (inter, hidden),
            "mlp.up_proj": (inter, hidden),
            "mlp.down_proj": (hidden, inter),
        }
        for name, shape in shapes.items():
            tensors[f"{prefix}{name}.weight"] = normal(*shape)
        tensors[f"{prefix}input_layernorm.weight"] = torch.ones(hidden)
        tensors[f"{prefix}post_attention_layernorm.weight"] = torch.ones(hidden)
    tensors["model.norm.weight"] = torch.ones(hidden)
    tensors["lm_head.weight"] = normal(config["vocab_size"], hidden)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
