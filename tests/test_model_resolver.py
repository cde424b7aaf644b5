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
    [folder] = [entry for entry in (cache_dir / "gguf").iterdir() if not entry.name.startswith(".")]  # not the lock
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


def test_concurrent_conversions_of_one_gguf_convert_once(llama_plain, tmp_path, cache_dir, monkeypatch):
    """Replicas of one node start together: the file lock lets one convert; the others wait and
    reuse its folder (each conversion holds the whole model in float32)."""
    import threading
    import time

    from pagedserve import gguf_checkpoint
    from pagedserve.config import default_cache_dir

    path = build_gguf(tmp_path / "shared.gguf", llama_plain, "Q8_0")
    real_convert, conversions = gguf_checkpoint.convert_gguf, []

    def counting_convert(source, folder):
        conversions.append(source)
        time.sleep(0.5)  # a wide window: without the lock every thread converts
        real_convert(source, folder)

    monkeypatch.setattr(gguf_checkpoint, "convert_gguf", counting_convert)
    folders = []
    threads = [threading.Thread(target=lambda: folders.append(gguf_checkpoint.converted_gguf(path, default_cache_dir()))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(conversions) == 1
    assert len(set(folders)) == 1 and len(folders) == 3
    assert (folders[0] / gguf_checkpoint.SOURCE_FILE).is_file()


def _ingress_tokenizer(spec: dict):
    import asyncio

    from pagedserve.cluster.prompt_renderer import PromptRenderer

    async def fetch_spec():
        return spec

    async def render():
        renderer = PromptRenderer(fetch_spec)
        thread = await renderer._tokenizer()  # the TokenizerThread the ingress encodes on
        return (thread.tokenizer if thread else None), await renderer.render("Hello, my name is")

    return asyncio.run(render())


def test_ingress_reads_a_gguf_tokenizer_without_converting_the_weights(smollm2_gguf, smollm2_dir, cache_dir, monkeypatch):
    """The ingress may sit on a small head pod: it reads the tokenizer from the GGUF metadata and
    never dequantizes the model."""
    from pagedserve import gguf_checkpoint
    from pagedserve.engine.tokenizer import load_tokenizer

    def no_conversion(source, folder):
        raise AssertionError(f"the ingress converted {source}")

    monkeypatch.setattr(gguf_checkpoint, "convert_gguf", no_conversion)
    tokenizer, rendered = _ingress_tokenizer({"model": str(smollm2_gguf), "tokenizer": None, "revision": None, "max_model_len": 2048})
    assert tokenizer is not None
    engine_tokenizer = load_tokenizer(str(smollm2_dir))  # the tokenizer the engine uses
    assert rendered["prompt_token_ids"] == engine_tokenizer.encode("Hello, my name is")
    assert tokenizer.chat_template == engine_tokenizer.chat_template
    assert not (cache_dir / "gguf").exists()


def test_ingress_takes_only_tokenizer_files_of_a_hub_model(tokenizer_dir, tmp_path, monkeypatch):
    """A hub snapshot with tokenizer files and no weights is enough for the ingress."""
    repo = tmp_path / "hf-home" / "hub" / "models--acme--tokenizer-only"
    shutil.copytree(tokenizer_dir, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer, rendered = _ingress_tokenizer({"model": "acme/tokenizer-only", "tokenizer": None, "revision": None, "max_model_len": 2048})
    assert tokenizer is not None
    assert rendered["prompt_token_ids"] == tokenizer.encode("Hello, my name is")
