"""Adapters over HTTP, as `vllm serve --enable-lora --lora-modules name=path` serves them: a
request's `model` names the adapter, /v1/models lists each adapter with its parent, and the
greedy answers equal the offline engine's under the same adapter (which equals PEFT's merged
model: test_lora_exactness.py). The real openai client against a real Serve app: its own,
because its engine has LoRA enabled."""

from __future__ import annotations

import openai
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.server_config import ServerConfig
from tests.cluster.conftest import deploy
from tests.lora.conftest import ADAPTERS, lora_request

APP, PREFIX, MODEL = "lora", "/lora", "tiny-base"
MAX_MODEL_LEN = 256
PROMPTS = ["Hello, my name is", "The capital of France is"]


@pytest.fixture(scope="module")
def client(serve_url, model_dirs, lora_adapters):
    from ray import serve

    modules = [f"{name}={folder}" for name, folder in lora_adapters["llama"].items()]
    config = ServerConfig(
        model=str(model_dirs["llama"]), served_model_name=MODEL, lora_modules=modules,
        engine={"max_model_len": MAX_MODEL_LEN, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
    )
    deploy(config, APP, PREFIX)
    yield openai.OpenAI(base_url=f"{serve_url}{PREFIX}/v1", api_key="unused", max_retries=0, timeout=120)
    serve.delete(APP)


@pytest.fixture(scope="module")
def offline(model_dirs):
    llm = LLM(str(model_dirs["llama"]), max_model_len=MAX_MODEL_LEN, enable_lora=True, max_loras=3, max_lora_rank=8)
    yield llm
    llm.shutdown()


def test_models_lists_each_adapter_with_its_parent(client, lora_adapters):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, *ADAPTERS}
    for name, folder in lora_adapters["llama"].items():
        assert (models[name].parent, models[name].root) == (MODEL, str(folder))


@pytest.mark.parametrize("name", [None, *ADAPTERS])
def test_a_requests_model_picks_its_adapter(client, offline, lora_adapters, name):
    adapter = lora_request(lora_adapters["llama"], name)
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False, lora_request=adapter)
    for prompt, want in zip(PROMPTS, expected):
        got = client.completions.create(model=name or MODEL, prompt=prompt, max_tokens=12, temperature=0.0)
        assert got.model == (name or MODEL) and got.choices[0].text == want.outputs[0].text, (name, prompt)
    # Streamed, the same.
    chunks = client.completions.create(model=name or MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0].outputs[0].text


def test_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    assert "no-such-adapter" in str(error.value)
