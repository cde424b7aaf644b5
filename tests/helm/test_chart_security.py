"""The chart's security settings, rendered by a real helm: pods that pass Pod Security
"restricted", no service-account token where nothing needs one, Ray token authentication on
every pod from a Secret, a NetworkPolicy that keeps the Ray ports to the release, the ingress and
metrics hub off the head, and the render-time refusals of an exposed server with no key and of
Ray without its token."""

from __future__ import annotations

import base64

import pytest
import yaml

from pagedserve.cluster.app import HUB_DEPLOYMENT, INGRESS_DEPLOYMENT
from tests.helm.conftest import CHART, CI_VALUES, one, pod_templates, render, run_helm, serve_config, template_args

VALUES_IDS = [path.name.removesuffix("-values.yaml") for path in CI_VALUES]
# Pod Security Standards, "restricted" profile (Kubernetes 1.25+): what it allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
SAFE_SECCOMP = {"RuntimeDefault", "Localhost"}
TOKEN_SECRET = "ps-pagedserve-ray-token"


@pytest.fixture(scope="module")
def rendered(helm) -> dict[str, list[dict]]:
    return {name: render(helm, [path]) for name, path in zip(VALUES_IDS, CI_VALUES)} | {"defaults": render(helm)}


def restricted_violations(pod: dict, extra_containers: list[dict] = ()) -> list[str]:
    """What in a pod spec Pod Security "restricted" (and so "baseline") would refuse."""
    found = []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            found.append(flag)
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']}: {sorted(kinds - RESTRICTED_VOLUMES)}")
    pod_context = pod.get("securityContext", {})
    pod_seccomp = pod_context.get("seccompProfile", {}).get("type")
    if pod_context.get("runAsUser") == 0:
        found.append("pod runAsUser 0")
    for container in [*pod.get("initContainers", []), *pod["containers"], *extra_containers]:
        name, context = container.get("name", "?"), container.get("securityContext", {})
        if context.get("privileged"):
            found.append(f"{name}: privileged")
        if context.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name}: allowPrivilegeEscalation not false")
        capabilities = context.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name}: capabilities not dropped")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name}: capabilities added")
        if not context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) or context.get("runAsNonRoot") is False:
            found.append(f"{name}: runAsNonRoot not true")
        if context.get("runAsUser") == 0:
            found.append(f"{name}: runAsUser 0")
        if context.get("seccompProfile", {}).get("type", pod_seccomp) not in SAFE_SECCOMP:
            found.append(f"{name}: seccomp not RuntimeDefault")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            found.append(f"{name}: hostPort")
    return found


def kuberay_init_container(worker: dict) -> dict:
    """The wait-gcs-ready init container KubeRay adds to each worker pod: the Ray container's
    securityContext, copied (ray-operator/controllers/ray/common/pod.go)."""
    return {"name": "wait-gcs-ready", "securityContext": worker["containers"][0].get("securityContext")}


@pytest.mark.parametrize("name", ["defaults", *VALUES_IDS])
def test_pods_pass_pod_security_restricted(rendered, name):
    service = one(rendered[name], "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    autoscaler = [{"name": "autoscaler", **cluster["autoscalerOptions"]}] if cluster.get("enableInTreeAutoscaling") else []
    for index, (group, _, pod) in enumerate(pod_templates(service)):
        extra = autoscaler if index == 0 else [kuberay_init_container(pod)]
        violations = restricted_violations(pod, extra)
        if name == "cpu":  # its model folder is a hostPath (the operator-play test mounts a local folder)
            assert violations == ["volume models: ['hostPath']"], (group, violations)
        else:
            assert violations == [], (group, violations)
        assert pod["securityContext"]["runAsUser"] == 1000  # the image's user (Dockerfile), numeric so runAsNonRoot can be verified


def test_the_restricted_check_catches_what_it_exists_for():
    good = {"securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}
    assert restricted_violations(good) == []
    assert restricted_violations({"containers": [{"name": "c"}]}) == [
        "c: allowPrivilegeEscalation not false", "c: capabilities not dropped", "c: runAsNonRoot not true", "c: seccomp not RuntimeDefault"]
    assert restricted_violations({**good, "hostNetwork": True}) == ["hostNetwork"]


def test_no_service_account_token_unless_the_autoscaler_needs_it(rendered):
    for name in ["defaults", *VALUES_IDS]:
        service = one(rendered[name], "RayService")
        autoscaling = service["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"]
        for index, (group, _, pod) in enumerate(pod_templates(service)):
            # The in-tree autoscaler (a head sidecar) asks the Kubernetes API for pods.
            assert pod["automountServiceAccountToken"] is (autoscaling and index == 0), (name, group)
    assert any(one(rendered[name], "RayService")["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] for name in VALUES_IDS)


def test_ray_token_from_a_secret_on_every_pod(rendered):
    for name in ["defaults", *VALUES_IDS]:
        docs = rendered[name]
        secret = one(docs, "Secret")
        assert secret["metadata"]["name"] == TOKEN_SECRET
        token = base64.b64decode(secret["data"]["auth_token"]).decode()
        assert len(token) == 64 and token.isalnum()
        cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
        assert cluster["authOptions"] == {"mode": "token", "secretName": TOKEN_SECRET}  # KubeRay's own calls use it
        for group, _, pod in pod_templates(one(docs, "RayService")):
            env = {item["name"]: item for item in pod["containers"][0]["env"]}
            assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}, group
            assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": TOKEN_SECRET, "key": "auth_token"}}, group
    tokens = {one(rendered[name], "Secret")["data"]["auth_token"] for name in rendered}
    assert len(tokens) == len(rendered)  # random per install (an upgrade keeps the cluster's: `lookup`)


def test_a_given_ray_token_secret_is_used_and_none_made(helm):
    docs = render(helm, settings={"rayAuth.secretName": "my-ray-token"})
    assert all(doc["kind"] != "Secret" for doc in docs)
    service = one(docs, "RayService")
    assert service["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": "my-ray-token"}
    for _, _, pod in pod_templates(service):
        env = {item["name"]: item for item in pod["containers"][0]["env"]}
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "my-ray-token", "key": "auth_token"}


def test_ray_auth_off_only_when_acknowledged(helm):
    docs = render(helm, settings={"rayAuth.mode": "disabled", "rayAuth.allowUnauthenticated": True})
    assert all(doc["kind"] != "Secret" for doc in docs)
    service = one(docs, "RayService")
    assert service["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "disabled"}
    for _, _, pod in pod_templates(service):
        assert all(not item["name"].startswith("RAY_AUTH") for item in pod["containers"][0].get("env", []))


def test_network_policy_keeps_ray_ports_to_the_release(rendered):
    docs = rendered["gpu-tp2-pp2"]
    policy = one(docs, "NetworkPolicy")["spec"]
    release = policy["podSelector"]["matchLabels"]
    assert release == {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/instance": "ps"}
    service = one(docs, "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    pod_labels = [cluster["headGroupSpec"]["template"]["metadata"]["labels"]]
    pod_labels += [group["template"]["metadata"]["labels"] for group in cluster["workerGroupSpecs"]]
    assert all(release.items() <= labels.items() for labels in pod_labels)  # it selects every Ray pod
    assert policy["policyTypes"] == ["Ingress"]
    own, serve, operator = policy["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": release}}]}  # every port, from the release's pods
    assert serve == {"ports": [{"protocol": "TCP", "port": 8000}]}  # from anywhere, the serve port only
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert operator["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}]


def test_network_policy_can_be_turned_off(helm):
    assert all(doc["kind"] != "NetworkPolicy" for doc in render(helm, settings={"networkPolicy.enabled": False}))


def test_ingress_and_hub_never_on_the_head(rendered, helm):
    for name in VALUES_IDS:
        service = one(rendered[name], "RayService")
        cluster = service["spec"]["rayClusterConfig"]
        head = cluster["headGroupSpec"]
        assert "resources" not in head and "resources" not in head["rayStartParams"], name  # the head never advertises it
        assert head["rayStartParams"]["num-cpus"] == "0"
        for group in cluster["workerGroupSpecs"]:
            assert float(group["resources"]["pagedserve_frontend"]) >= 2, (name, group["groupName"])
        overrides = {d["name"]: d for d in serve_config(service)["applications"][0]["deployments"]}
        for deployment in (INGRESS_DEPLOYMENT, HUB_DEPLOYMENT):  # the names build_app gives them
            options = {k: v for k, v in overrides[deployment]["ray_actor_options"].items() if k != "runtime_env"}
            assert options == {"num_cpus": 0, "resources": {"pagedserve_frontend": 1}}, (name, deployment)
    # With no worker group the head runs everything, and nothing asks for the resource.
    service = one(render(helm, settings={"workerGroups": []}), "RayService")
    assert [d["name"] for d in serve_config(service)["applications"][0]["deployments"]] == ["LLMServer"]


REFUSALS = [
    pytest.param({"ingress.enabled": True}, "ingress.enabled exposes the server outside the cluster, but no API key is set", id="ingress-no-key"),
    pytest.param({"service.type": "LoadBalancer"}, "service.type LoadBalancer exposes the server outside the cluster, but no API key is set", id="load-balancer-no-key"),
    pytest.param({"service.type": "NodePort"}, "service.type NodePort exposes", id="node-port-no-key"),
    pytest.param({"rayAuth.mode": "disabled"}, 'rayAuth.mode is "disabled": anyone who reaches the Ray ports', id="ray-auth-off"),
]


@pytest.mark.parametrize("settings, message", REFUSALS)
def test_refused_at_render(helm, settings, message):
    result = run_helm(helm, *template_args(settings=settings))
    assert result.returncode != 0, f"rendered although {settings} is unsafe"
    assert message in result.stderr, result.stderr
    if "API key" in message:
        assert "apiKey.secretName" in result.stderr and "kubectl create secret generic" in result.stderr


def test_exposed_with_a_key_renders(helm):
    docs = render(helm, settings={"ingress.enabled": True, "service.type": "LoadBalancer", "apiKey.secretName": "k"})
    assert one(docs, "Ingress")
