"""The offline LLM's defaults (vLLM's get_default_sampling_params): `generate` given no
SamplingParams samples as the model's generation_config.json says ("auto"), or with
SamplingParams' own defaults ("vllm"), or from another folder's file."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.generation_config import generation_defaults

PROMPTS = ["Once upon a time", "The capital of France is"]


@pytest.fixture(scope="module")
def greedy_by_default(model_dirs, tmp_path_factory):
    """The tiny Llama whose generation_config.json asks for greedy decoding (top_k is kept too)."""
    folder = tmp_path_factory.mktemp("gen_config") / "llama"
    shutil.copytree(model_dirs["llama"], folder)
    config = json.loads((folder / "generation_config.json").read_text()) if (folder / "generation_config.json").exists() else {}
    (folder / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0, "top_k": 5}))
    return folder


def test_generate_without_params_samples_as_the_model_says(greedy_by_default, hf_references):
    llm = LLM(str(greedy_by_default), max_model_len=128, dtype="float32")
    try:
        defaults = llm.get_default_sampling_params()
        assert defaults == SamplingParams(temperature=0.0, top_k=5)
        outputs = llm.generate(PROMPTS, use_tqdm=False)
        for output in outputs:  # greedy, and SamplingParams' default max_tokens
            assert output.outputs[0].token_ids == hf_references["llama"].greedy(output.prompt_token_ids, SamplingParams().max_tokens)
        # Given params, the caller's own stand (the defaults are not merged in, as in vLLM).
        sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=0, max_tokens=8), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in sampled] != [o.outputs[0].token_ids[:8] for o in outputs]
    finally:
        llm.shutdown()


def test_the_settings_vllm_and_a_folder(greedy_by_default, model_dirs, tmp_path):
    assert generation_defaults("vllm", str(greedy_by_default)) == {}
    assert generation_defaults("auto", str(greedy_by_default)) == {"temperature": 0.0, "top_k": 5}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.8}))
    assert generation_defaults(str(tmp_path), str(greedy_by_default)) == {"temperature": 0.3, "top_p": 0.8}
    llm = LLM(str(greedy_by_default), max_model_len=128, dtype="float32", generation_config="vllm")
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
    finally:
        llm.shutdown()
