"""Adapters over HTTP, as `vllm serve --enable-lora --lora-modules name=path` serves them: a
request's `model` names the adapter, /v1/models lists each adapter with its parent, and the
greedy answers equal the offline engine's under the same adapter (which equals PEFT's merged
model: test_lora_exactness.py). The real openai client against a real Serve app: its own,
because its engine has LoRA enabled."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import requests

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.server_config import ServerConfig
from tests.cluster.conftest import deploy, metric_per_replica, wait_until
from tests.lora.conftest import ADAPTERS, lora_request

APP, PREFIX, MODEL = "lora", "/lora", "tiny-base"
MAX_MODEL_LEN = 256
PROMPTS = ["Hello, my name is", "The capital of France is"]


@pytest.fixture(scope="module")
def base_url(serve_url, model_dirs, lora_adapters):
    from ray import serve

    modules = [f"{name}={folder}" for name, folder in lora_adapters["llama"].items()]
    config = ServerConfig(
        model=str(model_dirs["llama"]), served_model_name=MODEL, lora_modules=modules, lora_dirs=[str(lora_dir(lora_adapters))],
        engine={"max_model_len": MAX_MODEL_LEN, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
        # Two replicas and power of two choices, so that requests under one adapter reach both.
        deployment={"num_replicas": 2, "request_router": "power_of_two"},
    )
    deploy(config, APP, PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def lora_dir(lora_adapters) -> Path:
    """The folder the server may load adapters from at runtime (the llama adapters' parent)."""
    return lora_adapters["llama"]["all8"].parent


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


def adapters_per_replica(base_url: str) -> dict[str, float]:
    """Each replica's count of the adapters its engine serves."""
    return metric_per_replica(base_url, "pagedserve:num_lora_adapters", MODEL)


def test_an_adapter_loaded_at_runtime_serves_and_unloads(base_url, client, offline, lora_adapters):
    """Loaded, it serves exactly; unloaded, it is a 404 and every replica that held it drops it
    (a Serve handle reaches one replica: the unload goes out through the metrics hub)."""
    started = len(ADAPTERS)  # the --lora-modules ones, on each replica from its start

    def every_replica_has(count: int) -> bool:
        counts = adapters_per_replica(base_url)
        return len(counts) == 2 and set(counts.values()) == {count}

    wait_until(lambda: every_replica_has(started), 60, what="both replicas reporting their adapters")
    folder = lora_adapters["llama"]["qv4"]
    loaded = requests.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(folder)}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert "late" in {m.id for m in client.models.list().data}
    [expected] = offline.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False,
                                  lora_request=lora_request(lora_adapters["llama"], "qv4"))

    def on_every_replica() -> bool:  # each request lands on either replica (power of two choices)
        got = client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=12, temperature=0.0)
        assert got.choices[0].text == expected.outputs[0].text
        return every_replica_has(started + 1)

    wait_until(on_every_replica, 60, interval=0.2, what="the loaded adapter on both replicas", details=lambda: str(adapters_per_replica(base_url)))
    again = requests.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(folder)}, timeout=60)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert requests.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60).status_code == 200
    assert "late" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="Hi", max_tokens=2)
    wait_until(lambda: every_replica_has(started), 30, interval=0.2,
               what="every replica dropping the unloaded adapter", details=lambda: str(adapters_per_replica(base_url)))
    gone = requests.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=60)
    assert gone.status_code == 404


def test_no_request_makes_the_server_read_a_path_outside_its_lora_dirs(base_url, lora_adapters, tmp_path):
    """Outside the folders, through `..`, or through a symlink inside them that leads out: a 400
    naming lora_path, before any replica reads anything. Inside, a folder that is no adapter: a
    400 from the replica's check."""
    inside = lora_dir(lora_adapters)
    outside = lora_adapters["qwen2"]["all8"]
    link = inside / "leads-out"
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    not_an_adapter = inside / "empty"
    not_an_adapter.mkdir(exist_ok=True)
    for path, message in [
        (str(outside), "must lie inside one of the server's lora_dirs"),
        (f"{inside}/../../lora/qwen2/all8", "must not contain '..'"),
        (str(link), "must lie inside one of the server's lora_dirs"),
        (str(not_an_adapter), "has no adapter_config.json"),
    ]:
        answer = requests.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path}, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "lora_path", (path, answer.text)
        assert message in answer.json()["error"]["message"], answer.text


def test_the_adapter_routes_are_behind_the_api_key():
    from pagedserve.cluster.request_gate import OPEN_PATHS

    assert not any(path.endswith(OPEN_PATHS) for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"))
