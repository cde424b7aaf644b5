"""Sampling defaults from generation_config.json (`--generation-config auto|vllm|FOLDER`), applied
to the fields a request omits, never over the ones it sets."""

from __future__ import annotations

import asyncio
import json

from pagedserve.cluster.generation_defaults import GenerationDefaults
from pagedserve.engine.generation_config import read_generation_defaults
from pagedserve.cluster.protocol import ChatCompletionRequest

SMOLLM2 = {"temperature": 0.2, "top_p": 0.9, "eos_token_id": 2, "do_sample": True}


def folder_with(tmp_path, config) -> object:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_reads_the_sampling_fields_only(tmp_path):
    config = {**SMOLLM2, "top_k": 50, "repetition_penalty": 1.1, "min_p": "bad", "max_length": 20}
    assert read_generation_defaults(folder_with(tmp_path, config)) == {"temperature": 0.2, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}
    assert read_generation_defaults(tmp_path / "missing") == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_defaults(tmp_path) == {}


def test_settings_auto_vllm_and_folder(tmp_path):
    (tmp_path / "model").mkdir()
    model = folder_with(tmp_path / "model", SMOLLM2)
    other = tmp_path / "other"
    other.mkdir()
    folder_with(other, {"temperature": 0.7})

    async def model_folder():
        return model

    def defaults(setting):
        return asyncio.run(GenerationDefaults(setting, model_folder).get())

    assert defaults("auto") == {"temperature": 0.2, "top_p": 0.9}
    assert defaults("vllm") == {}
    assert defaults(str(other)) == {"temperature": 0.7}


def test_defaults_fill_only_omitted_fields():
    defaults = {"temperature": 0.2, "top_p": 0.9}
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], temperature=0.0)
    params = request.sampling_params(8, None, defaults)
    assert params.temperature == 0.0  # the request's own
    omitted = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}]).sampling_params(8, None, defaults)
    assert (omitted.temperature, omitted.top_p) == (0.2, 0.9)


def test_demo_folder_carries_smollm2s_recommended_sampling(tmp_path):
    from pagedserve.demo import write_recommended_sampling

    folder_with(tmp_path, {"eos_token_id": 2, "temperature": 1.0})
    write_recommended_sampling(tmp_path)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written == {"eos_token_id": 2, "temperature": 0.2, "top_p": 0.9}
    assert read_generation_defaults(tmp_path) == {"temperature": 0.2, "top_p": 0.9}
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    write_recommended_sampling(fresh)  # a folder without the file gets one
    assert read_generation_defaults(fresh) == {"temperature": 0.2, "top_p": 0.9}
