"""What `model=` may name: GGUF files of each tensor type, hub ids from a local hub cache, the
built-in names; and the errors for what cannot be loaded. No test reaches the network."""

from __future__ import annotations

import shutil

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.model_resolver import resolve_model_path
from tests.models import HFReference, build_gguf, build_model

PROMPTS = ["Hello, my name is", "The capital of France is Paris. The capital of Japan is", "A"]
# The test tokenizer's EOS is not in the GGUF (which has no tokenizer): HF would not stop on it.
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def llama_plain(artifacts, tokenizer_dir):
    """A Llama folder with default RoPE (GGUF metadata here carries no RoPE scaling)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    return build_model(artifacts / "llama-plain", "llama", tokenizer_dir, rope_parameters=rope)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_gguf_of_each_tensor_type_matches_hf(tensor_type, llama_plain, tokenizer_dir, tmp_path, cache_dir):
    """Dequantized at load, greedy float32 outputs equal transformers' load of the same file."""
    path = build_gguf(tmp_path / f"tiny-{tensor_type}.gguf", llama_plain, tensor_type)
    llm = LLM(str(path), tokenizer=str(tokenizer_dir), dtype="float32", max_model_len=256)
    try:
        reference = HFReference(path)
        for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False):
            assert output.outputs[0].token_ids == reference.greedy(output.prompt_token_ids, 16)
    finally:
        llm.shutdown()
    # Converted once: a second resolution finds the folder without converting again.
    [folder] = (cache_dir / "gguf").iterdir()
    assert resolve_model_path(str(path)) == folder


def test_gguf_without_tokenizer_needs_one(llama_plain, tmp_path, cache_dir):
    path = build_gguf(tmp_path / "no-tokenizer.gguf", llama_plain, "F16")
    with pytest.raises(ValueError, match="holds no tokenizer.*pass tokenizer="):
        LLM(str(path))


def test_unsupported_gguf_architecture_and_tensor_type(llama_plain, tmp_path, cache_dir):
    import gguf
    import numpy as np

    path = build_gguf(tmp_path / "gpt2.gguf", llama_plain, "F16", architecture="gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'; supported: llama, mistral"):
        resolve_model_path(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "llama")
    raw = np.zeros((4, 144), np.uint8)  # 4 rows of 256 IQ4_NL values (18 bytes per 32)
    writer.add_tensor("token_embd.weight", raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported quantization type IQ4_NL; supported: F32, F16, BF16, Q8_0"):
        resolve_model_path(str(tmp_path / "iq.gguf"))
    assert not (cache_dir / "gguf").exists() or not any((cache_dir / "gguf").iterdir())


def test_hub_id_from_a_local_hub_cache_offline(model_dirs, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 and a hub cache laid out as huggingface_hub writes it (HF_HOME/hub)."""
    repo = tmp_path / "hf-home" / "hub" / "models--acme--tiny-llama"
    shutil.copytree(model_dirs["llama"], repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path("acme/tiny-llama") == repo / "snapshots" / REVISION
    assert resolve_model_path("acme/tiny-llama", revision=REVISION) == repo / "snapshots" / REVISION
    from_hub = LLM("acme/tiny-llama", max_model_len=128)
    from_folder = LLM(str(model_dirs["llama"]), max_model_len=128)
    try:
        assert [o.outputs[0].token_ids for o in from_hub.generate(PROMPTS, GREEDY, use_tqdm=False)] == [
            o.outputs[0].token_ids for o in from_folder.generate(PROMPTS, GREEDY, use_tqdm=False)
        ]
    finally:
        from_hub.shutdown()
        from_folder.shutdown()
    with pytest.raises(FileNotFoundError, match="'acme/tiny-llama' \\(revision v2\\) is not available"):
        resolve_model_path("acme/tiny-llama", revision="v2")


def test_hub_id_missing_offline_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="'acme/absent'.*offline.*huggingface-cli download acme/absent"):
        LLM("acme/absent")


def test_unknown_model_lists_what_is_accepted(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local folder, a .gguf file, a model hub id"):
        LLM(str(tmp_path / "nowhere" / "model"))


def test_served_model_name_is_the_model_argument_as_given():
    from pagedserve.cluster.server_config import ServerConfig

    assert ServerConfig().model_name == "demo"
    assert ServerConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct").model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert ServerConfig(model="/models/x.gguf").model_name == "/models/x.gguf"
    assert ServerConfig(model="/models/x.gguf", served_model_name="small").model_name == "small"
