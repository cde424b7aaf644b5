"""Play the KubeRay operator with the chart's CPU values: Ray nodes started from the rendered pod
specs, serveConfigV2 deployed through the dashboard's REST API, KubeRay's probes, then the real
`openai` client against the serve port with the key from the Secret. The dashboard's queries are
checked against the running server's /metrics."""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass

import openai
import psutil
import pytest
import requests

from pagedserve import LLM, SamplingParams
from tests.helm.conftest import CHART, notes, one, pod_templates, render, serve_config
from tests.cluster.conftest import free_port
from pagedserve.cluster.app import HUB_DEPLOYMENT, INGRESS_DEPLOYMENT
from tests.helm.operator import PlayedCluster, group_start_params, new_cluster, pod_env, secrets_of, wait_for

MODEL_NAME = "tiny-llama"
SECRET = ("pagedserve-api-key", "api-key")


@dataclass
class Played:
    cluster: PlayedCluster
    serve_url: str
    api_key: str  # the Secret's value
    notes: str  # NOTES.txt as `helm install` prints it


@pytest.fixture(scope="module")
def played(helm, model_dirs):
    model = model_dirs["llama"]
    settings = {
        "server.model": str(model),
        "server.served_model_name": MODEL_NAME,
        # The hostPath is mounted at the same path in the pods, so the folder is where it is here.
        "model.hostPath": str(model.parent),
        "model.mountPath": str(model.parent),
        "apiKey": {"secretName": SECRET[0], "secretKey": SECRET[1]},
    }
    values = [CHART / "ci" / "cpu-values.yaml"]
    docs = render(helm, values, settings)
    rayservice = one(docs, "RayService")
    api_key = secrets.token_urlsafe(24)
    secret_data = {SECRET[0]: {SECRET[1]: api_key}, **secrets_of(docs)}  # the Ray token's is the chart's
    cluster = new_cluster(rayservice, secret_data)
    try:
        groups = pod_templates(rayservice)
        for index, ((_, _, pod), params) in enumerate(zip(groups, group_start_params(rayservice))):
            cluster.start_node(pod, params, pod_env(pod["containers"][0], secret_data), is_head=index == 0)
            if index == 0:
                wait_for(lambda: cluster.node_count() >= 1, 120, "head node up", cluster)
        wait_for(lambda: cluster.node_count() == len(groups), 120, "worker nodes joined", cluster)
        config = serve_config(rayservice)
        serve_port = free_port()  # the pod's 8000, here a free port on the shared host
        config["http_options"]["port"] = serve_port
        cluster.deploy(config)
        (app,) = config["applications"]
        wait_for(lambda: cluster.application_status(app["name"]) == "RUNNING", 300, "application RUNNING", cluster)
        yield Played(cluster, f"http://127.0.0.1:{serve_port}", api_key, notes(helm, values, settings))
    finally:
        cluster.tear_down()


def test_probes_pass_as_kuberay_sends_them(played):
    cluster, serve_url = played.cluster, played.serve_url
    for port in cluster.agent_ports:  # every pod's liveness/readiness: the raylet is healthy
        response = requests.get(f"http://127.0.0.1:{port}/api/local_raylet_healthz", timeout=10)
        assert response.status_code == 200 and "success" in response.text, response.text
    response = requests.get(f"{cluster.dashboard_url}/api/gcs_healthz", timeout=10)  # the head's
    assert response.status_code == 200 and "success" in response.text, response.text
    response = requests.get(f"{serve_url}/-/healthz", timeout=10)  # a serving pod's readiness
    assert response.status_code == 200 and "success" in response.text, response.text


def test_dashboard_rest_api_requires_the_cluster_token(played):
    cluster = played.cluster
    response = requests.get(f"{cluster.dashboard_url}/api/serve/applications/", timeout=10)
    assert response.status_code == 401
    wrong = {"X-Ray-Authorization": "Bearer " + "0" * 64}
    assert requests.get(f"{cluster.dashboard_url}/api/serve/applications/", headers=wrong, timeout=10).status_code == 403


def test_ingress_and_hub_run_on_a_worker_not_the_head(played):
    """The head pod is small and hosts the GCS: the ingress (tokenizer, request bodies) and the
    metrics hub run where the chart's worker-only resource is, never beside it."""
    cluster = played.cluster
    nodes = requests.get(f"{cluster.dashboard_url}/nodes?view=summary", headers=cluster.auth_headers, timeout=10).json()
    head_ids = {node["raylet"]["nodeId"] for node in nodes["data"]["summary"] if node["raylet"].get("isHeadNode")}
    assert len(head_ids) == 1
    details = requests.get(f"{cluster.dashboard_url}/api/serve/applications/", headers=cluster.auth_headers, timeout=10).json()
    deployments = details["applications"]["pagedserve"]["deployments"]
    for name in (INGRESS_DEPLOYMENT, HUB_DEPLOYMENT):
        nodes_of = [replica["node_id"] for replica in deployments[name]["replicas"]]
        assert nodes_of and not set(nodes_of) & head_ids, (name, nodes_of, head_ids)


def test_replicas_run_at_the_niceness_of_their_node(played):
    """The chart's pods start Ray's workers at the raylet's niceness (this process's), not Ray's 15:
    the ingress, the engine's replica and any process they start."""
    nodes = [psutil.Process(process.pid) for process in played.cluster.processes]
    descendants = [child for node in nodes for child in node.children(recursive=True)]
    replicas = [p for p in descendants if "ServeReplica" in " ".join(p.cmdline())]
    names = " ".join(" ".join(p.cmdline()) for p in replicas)
    assert INGRESS_DEPLOYMENT in names and "LLMServer" in names, names
    served_by = replicas + [child for replica in replicas for child in replica.children(recursive=True)]
    assert {p.nice() for p in served_by} == {os.nice(0)}, [(p.cmdline()[0], p.nice()) for p in served_by]


def test_chat_completion_with_the_secret_key(played, model_dirs):
    serve_url, api_key = played.serve_url, played.api_key
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    assert [model.id for model in client.models.list()] == [MODEL_NAME]
    messages = [{"role": "user", "content": "Hello!"}]
    response = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
    assert response.usage.completion_tokens == 8 and response.choices[0].finish_reason == "length"
    # The rendered config serves the checkpoint it names: greedy text equals the offline engine's.
    llm = LLM(str(model_dirs["llama"]), max_model_len=256)
    try:
        expected = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert response.choices[0].message.content == expected.text
    stranger = openai.OpenAI(base_url=f"{serve_url}/v1", api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        stranger.models.list()


def test_notes_curl_line_works(played):
    """The request NOTES.txt tells users to send, sent with the header it names."""
    serve_url, api_key, printed = played.serve_url, played.api_key, played.notes
    assert 'Authorization: Bearer $PAGEDSERVE_API_KEY' in printed
    body = json.loads(re.search(r"-d '(.+)'", printed).group(1))
    response = requests.post(
        f"{serve_url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {api_key}"}, timeout=120
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == MODEL_NAME


def test_dashboard_queries_only_exported_metrics(played):
    cluster, serve_url, api_key = played.cluster, played.serve_url, played.api_key
    client = openai.OpenAI(base_url=f"{serve_url}/v1", api_key=api_key, max_retries=0, timeout=120)
    client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=4)

    def exported_once_reported() -> set[str]:
        # Replicas report to the metrics hub periodically; finish reasons appear after the first report.
        text = requests.get(f"{serve_url}/metrics", timeout=30).text
        names = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{| )", text, re.M))
        return names if "pagedserve:request_success_total" in names else set()

    exported = wait_for(exported_once_reported, 60, "finished requests in /metrics", cluster)
    dashboard = json.loads((CHART / "dashboards" / "pagedserve.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    expressions.append(dashboard["templating"]["list"][1]["definition"])
    queried = {name for expr in expressions for name in re.findall(r"pagedserve:[a-z0-9_]+", expr)}
    assert len(queried) >= 13, queried  # every panel family: gauges, counters, four histograms
    assert queried <= exported, f"queried but not exported: {sorted(queried - exported)}"


def test_every_port_a_played_cluster_gives_out_is_its_own():
    """Ports found one at a time could repeat (a head once got one port for its GCS and its
    dashboard agent, and never came up): across a head and two workers, none repeats."""
    cluster = PlayedCluster(temp_dir="unused", auth_mode="disabled", auth_token="")
    given = [port for is_head in (True, False, False) for port in cluster.node_ports(is_head).values()]
    assert len(given) == len(set(given)) == len(cluster.ports_given)
