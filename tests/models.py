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
    """Greedy completions from Hugging Face transformers, with the log-probability of each chosen
    token, cached per (prompt, max_tokens). A `.gguf` path is loaded by transformers' own GGUF
    loader (dequantized to `dtype`)."""

    def __init__(self, path: Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        where = dict(gguf_file=path.name) if path.suffix == ".gguf" else {}
        folder = path.parent if where else path
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **where).eval()
        self.cache: dict[tuple[tuple[int, ...], int], tuple[list[int], list[float]]] = {}

    def greedy(self, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
        return self._generate(prompt_token_ids, max_tokens)[0]

    def greedy_logprobs(self, prompt_token_ids: list[int], max_tokens: int) -> list[float]:
        """The log-probability of each greedy token (log-softmax of HF's logits, in float64)."""
        return self._generate(prompt_token_ids, max_tokens)[1]

    @torch.inference_mode()
    def _generate(self, prompt_token_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        key = (tuple(prompt_token_ids), max_tokens)
        if key not in self.cache:
            input_ids = torch.tensor([prompt_token_ids])
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.model.config.pad_token_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt_token_ids):].tolist()
            logprobs = [torch.log_softmax(step[0].double(), -1)[token].item() for step, token in zip(out.logits, tokens)]
            self.cache[key] = (tokens, logprobs)
        return self.cache[key]


# Hugging Face Llama tensor names -> llama.cpp's, for GGUF files written by the tests.
_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def build_gguf(path: Path, hf_folder: Path, tensor_type: str, architecture: str = "llama") -> Path:
    """Write a Llama checkpoint folder as a GGUF file whose 2-D weights are `tensor_type`
    (F32, F16, BF16, Q8_0, Q4_0, Q4_1, ...), with no tokenizer metadata. Q and K rows are
    permuted as llama.cpp's converter does (transformers undoes it when it reads the file)."""
    import json

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    config = json.loads((hf_folder / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(config["vocab_size"])
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name, tensor in load_file(str(hf_folder / "model.safetensors")).items():
        array = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            array = _llama_cpp_permute(array, heads)
        elif name.endswith("k_proj.weight"):
            array = _llama_cpp_permute(array, kv_heads)
        if array.ndim == 1:  # norms stay float32, as llama.cpp keeps them
            writer.add_tensor(_gguf_name(name), array.astype(np.float32))
        else:
            data = gguf.quants.quantize(array, qtype)
            writer.add_tensor(_gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.self_attn.q_proj.weight
    module, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{suffix}"


def _llama_cpp_permute(weights, num_heads: int):
    rows = weights.shape[0]
    return weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
