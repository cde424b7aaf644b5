"""KubeRay's part, played on one machine: start Ray nodes from a rendered RayService's pod specs,
deploy its serveConfigV2 through the dashboard's REST API and probe the nodes as KubeRay does.

What differs from Kubernetes, and why: every pod has its own network namespace there, so the
chart's fixed container ports (6379, 8265, 8000, ...) never collide; here all nodes share one host
with other test runs, so each port is a free one. Secrets are a dictionary resolved the way
`secretKeyRef` resolves them. Every process lives under one `--temp-dir` and is a descendant of
the `ray start --block` processes started here; teardown kills exactly those (never `ray stop`,
which would stop every Ray on the machine)."""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

from tests.cluster.conftest import free_ports, wait_until

RAY = str(Path(sys.executable).parent / "ray")
# Ports a node listens on besides the head's own: each gets a free one.
NODE_PORT_FLAGS = (
    "metrics-export-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "runtime-env-agent-port",
    "node-manager-port",
    "object-manager-port",
)
HEAD_PORT_FLAGS = ("port", "dashboard-port", "ray-client-server-port")


def pod_env(container: dict, secret_data: dict[str, dict[str, str]]) -> dict[str, str]:
    """A container's env as the kubelet resolves it: literal values and secretKeyRef lookups."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secret_data[ref["name"]][ref["key"]]
    return env


def secrets_of(docs: list[dict]) -> dict[str, dict[str, str]]:
    """The Secrets a render creates, as `pod_env` takes them: name -> key -> decoded value."""
    return {
        doc["metadata"]["name"]: {key: base64.b64decode(value).decode() for key, value in doc.get("data", {}).items()}
        for doc in docs
        if doc["kind"] == "Secret"
    }


def group_start_params(rayservice: dict) -> list[dict[str, str]]:
    """Each group's rayStartParams as KubeRay completes them (head first, as pod_templates): a
    worker group's `resources` map becomes --resources (its custom resources; KubeRay's
    updateRayStartParamsResources)."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    params = [dict(cluster["headGroupSpec"]["rayStartParams"])]
    for group in cluster.get("workerGroupSpecs", []):
        group_params = dict(group["rayStartParams"])
        custom = {name: float(value) for name, value in group.get("resources", {}).items()}
        if custom:
            group_params["resources"] = json.dumps(custom)
        params.append(group_params)
    return params


def cpu_limit(container: dict) -> str:
    """KubeRay passes the container's CPU limit as --num-cpus unless rayStartParams sets it."""
    limit = str(container["resources"]["limits"]["cpu"])
    return str(int(limit[:-1]) / 1000) if limit.endswith("m") else limit


@dataclass
class PlayedCluster:
    temp_dir: str
    auth_mode: str  # the RayService's authOptions.mode: "token" or "disabled"
    auth_token: str
    gcs_address: str = ""
    dashboard_url: str = ""
    agent_ports: list[int] = field(default_factory=list)  # each node's dashboard agent (raylet health)
    processes: list[subprocess.Popen] = field(default_factory=list)
    ports_given: set[int] = field(default_factory=set)  # to every node so far: each port once

    def node_ports(self, is_head: bool) -> dict[str, int]:
        """A free port for each of a node's port flags, none given to this cluster before."""
        flags = NODE_PORT_FLAGS + (HEAD_PORT_FLAGS if is_head else ())
        return dict(zip(flags, free_ports(len(flags), self.ports_given)))

    @property
    def auth_headers(self) -> dict[str, str]:
        # KubeRay authenticates with X-Ray-Authorization, which proxies leave alone.
        return {"X-Ray-Authorization": f"Bearer {self.auth_token}"}

    def start_node(self, pod: dict, ray_start_params: dict[str, str], env: dict[str, str], is_head: bool) -> None:
        container = pod["containers"][0]
        params = dict(ray_start_params)
        if not is_head:
            params.setdefault("num-cpus", cpu_limit(container))
        ports = self.node_ports(is_head)
        params.update({flag: str(port) for flag, port in ports.items()})
        args = [RAY, "start", "--block", f"--temp-dir={self.temp_dir}"]
        args += ["--head"] if is_head else [f"--address={self.gcs_address}"]
        args += [f"--{name}={value}" for name, value in params.items()]
        # A pod has no RAY_ADDRESS or token of the test process's own Ray.
        node_env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS" and not key.startswith("RAY_AUTH")}
        node_env.update(env)
        # authOptions.mode=token: KubeRay puts the cluster's token in every Ray container.
        node_env["RAY_AUTH_MODE"] = self.auth_mode
        if self.auth_mode == "token":
            node_env["RAY_AUTH_TOKEN"] = self.auth_token
        with open(Path(self.temp_dir) / f"ray-start-{len(self.processes)}.log", "w") as log:
            self.processes.append(
                subprocess.Popen(args, env=node_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        self.agent_ports.append(ports["dashboard-agent-listen-port"])
        if is_head:
            self.gcs_address = f"127.0.0.1:{ports['port']}"
            self.dashboard_url = f"http://127.0.0.1:{ports['dashboard-port']}"

    def node_count(self) -> int:
        try:
            response = requests.get(f"{self.dashboard_url}/nodes?view=summary", headers=self.auth_headers, timeout=5)
        except requests.ConnectionError:
            return 0
        if response.status_code != 200:
            return 0
        summary = response.json()["data"]["summary"]
        return sum(1 for node in summary if node["raylet"]["state"] == "ALIVE")

    def deploy(self, serve_config: dict) -> None:
        """What KubeRay does with serveConfigV2: PUT it (as JSON) to the dashboard's Serve API."""
        response = requests.put(
            f"{self.dashboard_url}/api/serve/applications/", json=serve_config, headers=self.auth_headers, timeout=60
        )
        assert response.status_code == 200, f"{response.status_code}: {response.text}"

    def application_status(self, name: str) -> str:
        response = requests.get(f"{self.dashboard_url}/api/serve/applications/", headers=self.auth_headers, timeout=10)
        response.raise_for_status()
        application = response.json().get("applications", {}).get(name)
        if application and application["status"] == "DEPLOY_FAILED":
            raise AssertionError(f"{name} failed to deploy: {application['message']}")
        return application["status"] if application else "NOT_STARTED"

    def log_tail(self) -> str:
        tails = []
        for path in sorted(Path(self.temp_dir).glob("ray-start-*.log")):
            tails.append(f"== {path.name}\n" + path.read_text()[-2000:])
        return "\n".join(tails)

    def tear_down(self) -> None:
        """Kill every process this cluster started: the `ray start` processes, their descendants
        (GCS, raylets, dashboard, workers, replicas) and anything else running from its temp dir."""
        victims: dict[int, psutil.Process] = {}
        for process in self.processes:
            try:
                parent = psutil.Process(process.pid)
                victims.update({p.pid: p for p in [parent, *parent.children(recursive=True)]})
            except psutil.NoSuchProcess:
                pass
        for process in psutil.process_iter(["cmdline"]):
            if any(self.temp_dir in arg for arg in process.info["cmdline"] or ()):
                victims[process.pid] = process
        victims.pop(os.getpid(), None)
        for process in victims.values():
            _signal(process, signal.SIGTERM)
        _, alive = psutil.wait_procs(list(victims.values()), timeout=15)
        for process in alive:
            _signal(process, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=10)
        for process in self.processes:
            process.wait(timeout=10)


def _signal(process: psutil.Process, sig: int) -> None:
    try:
        process.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def new_cluster(rayservice: dict, secret_data: dict[str, dict[str, str]]) -> PlayedCluster:
    # Short: Ray's unix socket paths live under it and are limited to ~107 characters.
    temp_dir = tempfile.mkdtemp(prefix="psk", dir="/tmp")
    auth = rayservice["spec"]["rayClusterConfig"].get("authOptions", {})
    # authOptions.secretName: KubeRay takes the token from that Secret's auth_token, else makes one.
    token = secret_data.get(auth.get("secretName", ""), {}).get("auth_token") or secrets.token_hex(32)
    return PlayedCluster(temp_dir=temp_dir, auth_mode=auth.get("mode", "disabled"), auth_token=token)


def wait_for(predicate, timeout: float, what: str, cluster: PlayedCluster, interval: float = 0.5):
    """wait_until, reporting the played cluster's log tail on failure."""
    return wait_until(predicate, timeout, interval, what, cluster.log_tail)
