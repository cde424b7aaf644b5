"""The engine in the ingress replica's process (`engine_host: ingress`, cluster/local_engine.py),
the layout `pagedserve serve` runs by default: where 'auto' puts the engine, what is refused, the
in-process calls, and the OpenAI routes against it on real Ray Serve with the real `openai`
client, LoRA adapters by name and loaded at runtime included. The app here is its own: its
deployment graph (an ingress holding the engine and the metrics hub, no other deployment) is no
other module's. tests/cluster/test_cli_serve.py runs it through `pagedserve serve`; every other
served module runs LLMServer replicas."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import openai
import psutil
import pytest
import requests

from pagedserve import LLM, SamplingParams
from pagedserve.cluster.ingress import _renderer
from pagedserve.cluster.launcher import resolved_engine_host
from pagedserve.cluster.local_engine import LocalEngineClient, LocalHub, LocalServer
from pagedserve.cluster.metrics_hub import MetricsHub
from pagedserve.cluster.server_config import AutoscalingConfig, DeploymentConfig, ServerConfig
from pagedserve.engine.metrics import EngineStats
from pagedserve.inputs import tokens_prompt
from tests.cluster.conftest import deploy, metric_per_replica, metric_values, wait_until
from tests.lora.conftest import lora_adapters, lora_request  # noqa: F401 (lora_adapters: a fixture)

MODEL = "tiny-llama-local"
MAX_MODEL_LEN = 512
APP = "engine-in-ingress"
PREFIX = "/local"
LORA_ENGINE = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}


# ---- where the engine runs -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("engine_host", "deployment", "starts_ray", "resolved"),
    [
        ("auto", DeploymentConfig(), True, "ingress"),
        ("auto", DeploymentConfig(), False, "replicas"),  # RAY_ADDRESS: a cluster others may scale
        ("auto", DeploymentConfig(num_replicas=2), True, "replicas"),
        ("auto", DeploymentConfig(autoscaling=AutoscalingConfig(max_replicas=2)), True, "replicas"),
        ("auto", DeploymentConfig(autoscaling_config={"max_replicas": 1}), True, "replicas"),
        ("replicas", DeploymentConfig(), True, "replicas"),
        ("ingress", DeploymentConfig(), False, "ingress"),
    ],
)
def test_auto_is_the_ingress_where_this_command_starts_ray_for_one_fixed_engine(engine_host, deployment, starts_ray, resolved):
    config = ServerConfig(engine_host=engine_host, deployment=deployment)
    assert resolved_engine_host(config, starts_ray) == resolved


@pytest.mark.parametrize("deployment", [{"num_replicas": 2}, {"autoscaling": {"max_replicas": 3}}])
def test_the_ingress_cannot_host_a_scaled_engine(deployment):
    with pytest.raises(ValueError, match="engine_host 'ingress' runs one engine.*use engine_host 'replicas'"):
        ServerConfig(engine_host="ingress", deployment=deployment)


def test_an_unknown_engine_host_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="'auto', 'ingress' or 'replicas'"):
        ServerConfig.load(overrides={"engine_host": "sidecar"})


def test_a_serve_config_which_scales_the_llmserver_deployment_refuses_the_ingress():
    from pagedserve.cluster.app import serve_application_config

    with pytest.raises(ValueError, match="engine_host 'ingress' has no LLMServer deployment.*'auto' or 'replicas'"):
        serve_application_config(ServerConfig(engine_host="ingress"), "app")
    assert serve_application_config(ServerConfig(), "app")["deployments"] == [{"name": "LLMServer", "num_replicas": 1}]


# ---- the in-process calls (a stand-in server: a unit test of the adapter) ------------------


class _Server:
    def __init__(self):
        self.closed = []
        self.tokenizer = _Tokenizer()

    async def prompt_spec(self):
        raise AssertionError("an engine in this process lends its tokenizer: nothing to fetch")

    async def tokenize(self, prompt, messages, add_special_tokens):
        return [len(prompt), add_special_tokens]

    def stats(self):
        return "sync"

    def check_health(self):
        raise RuntimeError("engine is dead: test")

    async def generate(self, request_id, prompt, params, resume=None):
        try:
            for i in range(100):
                yield (request_id, i)
        finally:
            self.closed.append(request_id)


def test_local_methods_are_awaited_like_a_handles():
    server = LocalServer(_Server())
    assert asyncio.run(server.tokenize.remote("abc", None, True)) == [3, True]
    assert asyncio.run(server.stats.remote()) == "sync"
    with pytest.raises(RuntimeError, match="engine is dead"):
        server.check_health()
    assert not hasattr(server, "__deepcopy__")  # protocols probed by copy and pickle are not the server's methods


class _Tokenizer:
    async def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


def test_the_renderer_takes_the_engines_tokenizer_in_this_process():
    """No second copy of the tokenizer, and no call to fetch where the engine's comes from."""
    renderer = _renderer(LocalServer(_Server()))
    assert asyncio.run(renderer.render("ab")) == tokens_prompt([97, 98], "ab")
    assert asyncio.run(renderer.render(tokens_prompt([5]))) == tokens_prompt([5])


def test_a_consumer_that_stops_early_closes_the_engine_stream():
    fake = _Server()
    client = LocalEngineClient(LocalServer(fake))

    async def first_two():
        stream = client.generate("r1", "hi", SamplingParams())
        items = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return items

    assert asyncio.run(first_two()) == [("r1", 0), ("r1", 1)]
    assert fake.closed == ["r1"]  # the engine request's stream closed: LLMServer aborts it


def test_the_local_hub_answers_the_loop_and_the_stats_thread_alike():
    """The routes await the hub's methods; the engine's statistics thread reads `result()`. A
    retired adapter id reaches the engine through the report's reply, as from the deployment."""
    hub = LocalHub(MetricsHub())
    assert hub.report.remote("m", "r1", EngineStats()).result(timeout_s=10) == []

    async def routes():
        first = await asyncio.wait_for(hub.new_lora_id.remote(5), 1)
        await hub.retire_lora.remote("m", first)
        return first, await hub.new_lora_id.remote(1), await hub.render.remote()

    first, second, text = asyncio.run(routes())
    assert (first, second) == (5, 6)  # never an id handed out before
    assert 'pagedserve:num_requests_running{model_name="m",replica="r1"}' in text
    replies = []
    reporter = threading.Thread(target=lambda: replies.append(hub.report.remote("m", "r1", EngineStats()).result(timeout_s=10)))
    reporter.start()
    reporter.join()
    assert replies == [[5]]
    assert not hasattr(hub, "__deepcopy__")


# ---- served -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_url(serve_url, model_dirs, lora_adapters):
    from ray import serve

    # The engine core in its own process, as `pagedserve serve` runs it on a machine of its own;
    # an adapter served by name, and others loadable at runtime from its folder.
    engine = {"max_model_len": MAX_MODEL_LEN, "engine_core_process": True, **LORA_ENGINE}
    adapters = lora_adapters["llama"]
    config = ServerConfig(
        model=str(model_dirs["llama"]), served_model_name=MODEL, engine_host="ingress", engine=engine,
        lora_modules=[f"qv4={adapters['qv4']}"], lora_dirs=[str(adapters["qv4"].parent)],
    )
    deploy(config, APP, PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dirs):
    llm = LLM(str(model_dirs["llama"]), max_model_len=MAX_MODEL_LEN, **LORA_ENGINE)
    yield llm
    llm.shutdown()


def greedy(offline: LLM, prompt, max_tokens: int = 16):
    return offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0].outputs[0]


def test_the_app_is_the_ingress_alone_and_its_metrics_are_the_engines(base_url, client):
    """No LLMServer and no MetricsHub deployment: the engine and the hub live in the ingress."""
    from ray import serve

    assert set(serve.status().applications[APP].deployments) == {"OpenAIIngress"}
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    running = wait_until(lambda: metric_per_replica(base_url, "pagedserve:num_requests_running", MODEL), timeout=10)
    assert [replica for replica in running if "OpenAIIngress" in replica] == list(running), running


def test_greedy_completions_and_chat_match_offline(client, offline):
    expected = greedy(offline, "Hello, my name is")
    response = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=16, temperature=0)
    assert (response.choices[0].text, response.choices[0].finish_reason) == (expected.text, expected.finish_reason)
    assert response.usage.completion_tokens == len(expected.token_ids)
    stream = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=16, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected.text
    messages = [{"role": "user", "content": "Name a colour"}]
    [chat] = offline.chat([messages], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == chat.outputs[0].text


def test_concurrent_streams_match_offline_and_a_bad_request_disturbs_none(base_url, offline):
    prompts = [f"Story number {i}: once upon a time" for i in range(12)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])

    async def bad(client: openai.AsyncOpenAI) -> str:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=-1)
        return str(caught.value)

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts[:6]), bad(client), *(one(client, p) for p in prompts[6:]))

    texts = asyncio.run(run_all())
    assert "temperature" in texts.pop(6)
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert texts == [e.outputs[0].text for e in expected]


def test_a_client_that_leaves_aborts_its_request_and_frees_its_blocks(base_url):
    labels = (("model_name", MODEL),)
    aborts = ("pagedserve:request_success_total", (("finished_reason", "abort"), *labels))
    tokens = ("pagedserve:generation_tokens_total", labels)
    before = metric_values(base_url)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=30) as response:
        assert response.status_code == 200, response.text
        assert next(line for line in response.iter_lines(decode_unicode=True) if line.startswith("data:"))

    def freed() -> bool:
        now = metric_values(base_url)
        return now.get(aborts, 0) == before.get(aborts, 0) + 1 and now[("pagedserve:kv_cache_usage_perc", labels)] == 0.0

    wait_until(freed, timeout=15, what="the abort, and the request's blocks freed", details=lambda: str(metric_values(base_url)))
    assert metric_values(base_url)[tokens] - before.get(tokens, 0) < 500


def test_models_health_tokenize_detokenize(client, base_url, offline):
    assert [model.id for model in client.models.list().data] == [MODEL, "qv4"]
    assert requests.get(f"{base_url}/health", timeout=10).json() == {"status": "ok"}
    tokens = requests.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": "café 日本"}, timeout=10).json()
    assert tokens["tokens"] == offline.get_tokenizer().encode("café 日本")
    text = requests.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}, timeout=10).json()
    assert text == {"prompt": "café 日本"}
    bad = requests.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": [10**9]}, timeout=10)
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]


def test_adapters_by_name_and_loaded_at_runtime_match_offline(base_url, client, offline, lora_adapters):
    """The adapter routes reach the engine in this process too (`check_lora`, then the engine
    loads the weights with the first request); unloaded, the name is a 404 again."""
    adapters = lora_adapters["llama"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for name in ("qv4", "all8"):
        if name == "all8":
            loaded = requests.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapters[name])}, timeout=60)
            assert loaded.status_code == 200, loaded.text
        [expected] = offline.generate(["Hello, my name is"], params, use_tqdm=False, lora_request=lora_request(adapters, name))
        got = client.completions.create(model=name, prompt="Hello, my name is", max_tokens=12, temperature=0.0)
        assert got.choices[0].text == expected.outputs[0].text, name
    assert requests.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "all8"}, timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="all8", prompt="Hi", max_tokens=2)


def test_a_dead_engine_is_503_until_serve_replaces_the_ingress(client, base_url, ray_cluster):
    """The ingress's own health check carries the engine's: Serve replaces the replica, engine
    and all. (Last here: it restarts the module's app.)"""
    from ray.util.state import list_actors

    address = ray_cluster.get_runtime_context().gcs_address
    [ingress] = list_actors(address=address, filters=[("class_name", "=", f"ServeReplica:{APP}:OpenAIIngress"), ("state", "=", "ALIVE")], detail=True)
    [core] = [p for p in psutil.Process(ingress.pid).children() if "pagedserve.engine.core.proc" in " ".join(p.cmdline())]
    os.kill(core.pid, signal.SIGKILL)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=8)
    assert info.value.status_code == 503 and "Traceback" not in info.value.body["message"]

    def answers() -> bool:
        try:
            return client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens >= 1
        except (openai.APIStatusError, openai.APIConnectionError):
            return False

    wait_until(answers, timeout=120, interval=1.0, what="a new ingress replica, with a new engine, answering")
    assert requests.get(f"{base_url}/health", timeout=10).json() == {"status": "ok"}
