"""Loading checkpoints: sharded safetensors, and clear errors for folders that cannot load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.workers.model_loader import checkpoint_files


def copy_checkpoint(source, target):
    shutil.copytree(source, target)
    return target


def greedy_tokens(llm: LLM, prompt: str, max_tokens: int = 12) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_sharded_checkpoint_with_index(tmp_path, model_dirs, hf_references, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dirs["qwen2"]), dtype=torch.float32)
    folder = tmp_path / "sharded"
    model.save_pretrained(str(folder), max_shard_size="60KB")
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, folder / item.name)
    assert len(checkpoint_files(folder)) > 2 and (folder / "model.safetensors.index.json").is_file()
    llm = LLM(str(folder), max_model_len=128)
    try:
        prompt_ids = llm.get_tokenizer().encode("The capital of France is")
        assert greedy_tokens(llm, "The capital of France is") == hf_references["qwen2"].greedy(prompt_ids, 12)
    finally:
        llm.shutdown()


def test_missing_folder_is_named():
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        LLM("/no/such/model")


def test_folder_without_weights_is_named(tmp_path, model_dirs):
    folder = copy_checkpoint(model_dirs["llama"], tmp_path / "noweights")
    for path in folder.glob("*.safetensors"):
        path.unlink()
    with pytest.raises(FileNotFoundError, match=f"{folder}.*safetensors"):
        LLM(str(folder))


def test_unsupported_architecture_is_named(tmp_path, model_dirs):
    folder = copy_checkpoint(model_dirs["llama"], tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(folder))


def test_missing_tensor_is_named(tmp_path, model_dirs):
    folder = copy_checkpoint(model_dirs["llama"], tmp_path / "partial")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights for model\.layers\.1\.mlp\.down_proj\.weight"):
        LLM(str(folder))


def test_corrupt_shard_is_a_clear_error(tmp_path, model_dirs):
    folder = copy_checkpoint(model_dirs["llama"], tmp_path / "corrupt")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="cannot read weights from .*model.safetensors"):
        LLM(str(folder))


def test_index_naming_an_absent_shard(tmp_path, model_dirs):
    folder = copy_checkpoint(model_dirs["llama"], tmp_path / "badindex")
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        LLM(str(folder))


def test_tiny_model_builds_and_generates(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    llm = LLM("tiny")
    try:
        first = greedy_tokens(llm, "Hello, my name is", 8)
        assert len(first) == 8
        assert (tmp_path / "tiny-v1" / "model.safetensors").is_file()
    finally:
        llm.shutdown()
    # Built once, deterministically: a second engine on the same folder agrees.
    again = LLM("tiny")
    try:
        assert greedy_tokens(again, "Hello, my name is", 8) == first
    finally:
        again.shutdown()
