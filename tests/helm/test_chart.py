"""The chart, rendered by a real helm: lint, every committed values file rendered and validated
(the RayService against KubeRay's CRD, core kinds against Kubernetes' schemas, serveConfigV2
against Serve's schema and ServerConfig), KubeRay's conventions, and the render-time failures."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from pagedserve.cluster.server_config import DeploymentConfig, ServerConfig
from pagedserve.config import EngineConfig
from pagedserve.cluster.app import HUB_DEPLOYMENT, INGRESS_DEPLOYMENT, SCALE_FIELDS, serve_application_config
from pagedserve.cluster.serve_engine_client import ingress_env_vars
from tests.helm.conftest import CHART, CI_VALUES, REPO, one, pod_templates, render, run_helm, serve_config

CRD = REPO / "tests" / "data" / "kuberay" / "ray.io_rayservices.yaml"
KUBERNETES_VERSION = "1.35.0"
CORE_KINDS = {"ConfigMap", "Ingress", "Service", "Secret", "NetworkPolicy"}
VALUES_IDS = [path.name.removesuffix("-values.yaml") for path in CI_VALUES]


def pinned(package: str) -> str:
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.startswith(f"{package}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"{package} is not pinned in constraints.txt")


@lru_cache(maxsize=1)
def rayservice_schema() -> dict:
    """KubeRay's v1 schema, closed where the API server would prune: an unknown (misspelt) field
    is silently dropped by Kubernetes, so here it is an error."""
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
    _close(schema)
    return schema


def _close(node) -> None:
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for value in node.values():
            _close(value)
    elif isinstance(node, list):
        for value in node:
            _close(value)


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict]]:
    return {name: render(helm, [path]) for name, path in zip(VALUES_IDS, CI_VALUES)} | {"defaults": render(helm)}


def test_the_values_files_cover_the_issue():
    assert {"cpu", "gpu-tp2-pp2", "autoscaling", "apikey-monitoring"} <= set(VALUES_IDS)


@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=["defaults", *VALUES_IDS])
def test_helm_lint(helm, values):
    args = ["lint", str(CHART), "--strict"] + (["-f", str(values)] if values else [])
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["defaults", *VALUES_IDS])
def test_manifests_validate(rendered, name):
    import kubernetes_validate

    docs = rendered[name]
    assert [doc["kind"] for doc in docs].count("RayService") == 1
    for doc in docs:
        if doc["kind"] == "RayService":
            jsonschema.Draft7Validator(rayservice_schema()).validate(doc)
        elif doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        else:
            assert doc["kind"] == "ServiceMonitor" and doc["apiVersion"] == "monitoring.coreos.com/v1"


@pytest.mark.parametrize("name", VALUES_IDS)
def test_serve_config_is_the_server_values(rendered, name):
    from ray.serve.schema import ServeDeploySchema

    config = serve_config(one(rendered[name], "RayService"))
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "pagedserve.cluster.app:build_app"
    assert config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())["server"]
    given = yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())["server"]
    values = merged(defaults, given)
    ServerConfig(**values)
    # The values, nothing added or lost, with the replica count moved into Serve's `deployments:`
    # override (a scale edit then restarts nothing), exactly as serve_application_config puts it.
    expected = serve_application_config(ServerConfig(**values), "pagedserve")
    # Plus the ingress and the hub kept off the head (test_chart_security checks where they go).
    # These replace the code's options, so the ingress's repeat its environment (app.py).
    frontend = {"num_cpus": 0, "resources": {"pagedserve_frontend": 1}}
    ingress = {**frontend, "runtime_env": {"env_vars": ingress_env_vars()}}
    expected["deployments"] += [
        {"name": INGRESS_DEPLOYMENT, "ray_actor_options": ingress}, {"name": HUB_DEPLOYMENT, "ray_actor_options": frontend}
    ]
    assert config["applications"] == [expected]
    assert app.args == {**values, "deployment": {k: v for k, v in values["deployment"].items() if k not in SCALE_FIELDS}}


def merged(defaults: dict, given: dict) -> dict:
    """Helm's merge of a values file over the chart's values.yaml."""
    out = dict(defaults)
    for key, value in given.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def test_values_schema_lists_exactly_the_config_fields():
    schema = json.loads((CHART / "values.schema.json").read_text())
    server = schema["properties"]["server"]["properties"]
    assert set(server) == set(ServerConfig.model_fields)
    assert set(server["engine"]["properties"]) == set(EngineConfig.model_fields) - {"model"}
    assert set(server["deployment"]["properties"]) == set(DeploymentConfig.model_fields)


def test_values_schema_is_generated_from_the_config_models():
    """Each field's type, range and description come from pagedserve/config.py (one source):
    `python tools/values_schema.py` regenerates them."""
    result = subprocess.run([sys.executable, "tools/values_schema.py", "--check"], cwd=CHART.parents[1], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_kuberay_conventions(rendered):
    service = one(rendered["gpu-tp2-pp2"], "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == pinned("ray")
    assert cluster["authOptions"] == {"mode": "token", "secretName": "ps-pagedserve-ray-token"}
    assert service["spec"]["rayClusterDeletionDelaySeconds"] >= ServerConfig().graceful_shutdown_s
    groups = pod_templates(service)
    head_params = groups[0][1]
    assert head_params == {"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0"}
    head_ports = {p["name"]: p["containerPort"] for p in groups[0][2]["containers"][0]["ports"]}
    assert head_ports == {"gcs": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080}
    for name, _, pod in groups:
        container = pod["containers"][0]
        assert container["image"] == "ghcr.io/pagedserve/pagedserve:0.1.0-cuda"
        # the node's replicas hand their streams over first, for the drain timeout and a margin
        drain_wait = ServerConfig().drain_timeout_s + 10
        assert container["lifecycle"]["preStop"]["exec"]["command"][-1] == f"python -m pagedserve.cluster.node_drain --timeout-s {drain_wait:.0f}; ray stop"
        assert pod["terminationGracePeriodSeconds"] == drain_wait + 30
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    (worker_name, _, worker) = groups[1]
    limits = worker["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 2
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in worker["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["containers"][0]["volumeMounts"]


def test_cpu_cluster_uses_the_cpu_image_and_no_gpus(rendered):
    service = one(rendered["cpu"], "RayService")
    for _, _, pod in pod_templates(service):
        container = pod["containers"][0]
        assert container["image"].endswith("-cpu")
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
        assert all(volume["name"] != "dshm" for volume in pod["volumes"])


def test_head_runs_replicas_when_there_are_no_workers(helm):
    service = one(render(helm, settings={"workerGroups": []}), "RayService")
    assert "workerGroupSpecs" not in service["spec"]["rayClusterConfig"]
    assert pod_templates(service)[0][1] == {"dashboard-host": "0.0.0.0"}


def test_api_key_reaches_every_pod_through_its_secret(rendered):
    docs = rendered["apikey-monitoring"]
    for _, _, pod in pod_templates(one(docs, "RayService")):
        env = {item["name"]: item for item in pod["containers"][0]["env"]}
        env.pop("RAY_AUTH_MODE")  # Ray's own token, test_chart_security
        env.pop("RAY_worker_niceness")  # test_ray_workers_start_at_the_raylets_niceness
        assert env["PAGEDSERVE_API_KEY"] == {
            "name": "PAGEDSERVE_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "pagedserve-api-key", "key": "api-key"}},
        }
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
        assert all("value" not in item for item in env.values())
    # The only Secret the chart writes is the Ray token's: never the API key's.
    assert [doc["metadata"]["name"] for doc in docs if doc["kind"] == "Secret"] == ["ps-pagedserve-ray-token"]


def test_ray_workers_start_at_the_raylets_niceness(rendered):
    """Ray would start the replicas and the engine at nice 15 (pagedserve/ray_env.py says why not);
    test_operator_play finds them at the raylet's niceness on a cluster started from these pods."""
    for name, docs in rendered.items():
        for group, _, pod in pod_templates(one(docs, "RayService")):
            env = {item["name"]: item for item in pod["containers"][0]["env"]}
            assert env["RAY_worker_niceness"] == {"name": "RAY_worker_niceness", "value": "0"}, (name, group)


def test_monitoring_scrapes_the_service_once(rendered):
    docs = rendered["apikey-monitoring"]
    service = one(docs, "RayService")["spec"]["serveService"]
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"] == [{"port": "serve", "path": "/metrics", "interval": "15s"}]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert service["spec"]["ports"] == [{"name": "serve", "port": 80, "targetPort": 8000}]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    ingress = one(docs, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"name": "serve"}}


def test_dashboard_ships_as_a_configmap_and_a_file(rendered):
    config_map = one(rendered["apikey-monitoring"], "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = (REPO / "dashboards" / "pagedserve.json").read_text()
    assert shipped == (CHART / "dashboards" / "pagedserve.json").read_text()
    assert json.loads(config_map["data"]["pagedserve.json"]) == json.loads(shipped)
    assert all(doc["kind"] != "ConfigMap" for doc in rendered["cpu"])


def test_dashboard_queries_aggregate_over_replicas():
    """/metrics has one series per replica (a `replica` label), and Prometheus adds its own pod
    labels: every panel aggregates each metric by model_name (and le for a histogram), never per
    replica. Sums for counts and rates; KV-cache usage, a fraction, is averaged."""
    import re

    dashboard = json.loads((REPO / "dashboards" / "pagedserve.json").read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert expressions
    for expr in expressions:
        selectors = re.findall(r"pagedserve:[a-z0-9_]+", expr)
        groupings = re.findall(r"\b(sum|avg) by \(([^)]*)\)", expr)
        assert selectors and len(groupings) == len(selectors), expr
        for _, labels in groupings:
            names = {label.strip() for label in labels.split(",")}
            assert "model_name" in names and names <= {"model_name", "le", "finished_reason"}, expr


BAD_COMBINATIONS = [
    pytest.param(
        {"server.api_key": "sk-123"}, "server.api_key must not be given in plain text", id="plain-text-api-key"
    ),
    pytest.param(
        {"server.engine.tensor_parallel_size": 4, "workerGroups": [{"name": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "gpus": 2}]},
        "tensor_parallel_size x pipeline_parallel_size = 4 GPUs per replica x 1 replicas (server.deployment.num_replicas) "
        "needs 4 GPUs, but the worker groups can have at most 2",
        id="tp-over-gpus",
    ),
    pytest.param(
        {"server.deployment.autoscaling_config": {"min_replicas": 1, "max_replicas": 3},
         "workerGroups": [{"name": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 2, "gpus": 1}]},
        "x 3 replicas (server.deployment.autoscaling_config.max_replicas) needs 3 GPUs, but the worker groups can have at most 2",
        id="autoscaling-over-gpus",
    ),
    pytest.param(
        {"server.engine.device": "cuda"}, 'server.engine.device is "cuda" but no worker group has GPUs', id="cuda-without-gpu-group"
    ),
    pytest.param(
        {"model.persistentVolumeClaim": "a", "model.hostPath": "/b"}, "give one of them", id="two-model-volumes"
    ),
    pytest.param(
        {"server.http_ingress": "direct"}, 'server.http_ingress is "direct", which only `pagedserve serve`', id="direct-ingress"
    ),
    pytest.param(
        {"server.engine_host": "ingress"}, 'server.engine_host is "ingress", but on KubeRay the engine runs in the LLMServer', id="engine-in-ingress"
    ),
    pytest.param(
        {"rayClusterDeletionDelaySeconds": 10},
        "rayClusterDeletionDelaySeconds (10) is shorter than server.graceful_shutdown_s (30)",
        id="deletion-before-drain",
    ),
    pytest.param(
        {"workerGroups": [{"name": "w", "replicas": 3, "minReplicas": 0, "maxReplicas": 2}]},
        'workerGroups "w": replicas (3) must be between minReplicas (0) and maxReplicas (2)',
        id="replicas-out-of-range",
    ),
    pytest.param({"server.engine.max_model_lenn": 3}, "'max_model_lenn' not allowed", id="schema-unknown-engine-key"),
    pytest.param({"workerGroups": [{"name": "w", "replicas": 1, "minReplicas": 1, "maxReplicas": 1, "gpus": "two"}]},
                 "/workerGroups/0/gpus", id="schema-wrong-type"),
]


@pytest.mark.parametrize("settings, message", BAD_COMBINATIONS)
def test_bad_combination_fails_with_its_message(helm, settings, message):
    from tests.helm.conftest import template_args

    result = run_helm(helm, *template_args(settings=settings))
    assert result.returncode != 0, f"rendered although {settings} is invalid"
    assert message in result.stderr, result.stderr


def test_good_gpu_combination_renders(helm):
    """The boundary of the GPU check: exactly enough GPUs renders."""
    groups = [{"name": "gpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 2, "gpus": 2}]
    render(helm, settings={"server.engine.tensor_parallel_size": 2, "server.deployment.num_replicas": 2, "workerGroups": groups})
    # An engine pinned to the CPU needs no GPUs, whatever the worker groups have.
    render(helm, settings={"server.engine.tensor_parallel_size": 8, "server.engine.device": "cpu", "workerGroups": groups})


def test_notes_say_how_to_reach_the_endpoint(helm):
    from tests.helm.conftest import notes

    printed = notes(helm, [CHART / "ci" / "apikey-monitoring-values.yaml"])
    assert "svc/ps-pagedserve-serve 8000:80" in printed
    assert "https://llm.example.com/v1" in printed
    assert "kubectl get secret -n llm pagedserve-api-key -o jsonpath='{.data.api-key}' | base64 -d" in printed
    assert '"model": "qwen3-0.6b"' in printed and "WARNING" not in printed
    assert "WARNING: no API key" in notes(helm)
