"""configs/cluster-local.yaml's own commands, run on one machine as the launcher would run them
on two: the head's setup makes the token, the file in `cluster_synced_files` is copied to the
worker (what Ray's autoscaler does over rsync), then the head's and the worker's `ray start`
commands run as written, plus the ports and temp dir two nodes on one host need. The cluster
then refuses whoever lacks the token.

Each node has its own HOME (its ~/.ray/auth_token). Only processes started here are stopped
(never `ray stop`, which the YAML runs first on a fresh node and which would stop every Ray on
this machine)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import requests
import yaml

from tests.cluster.test_config_security import start_environment
from tests.helm.operator import PlayedCluster, wait_for

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "cluster-local.yaml"
BIN = str(Path(sys.executable).parent)
# Flags the YAML sets that a second node on the same host must not share (or that need the
# launcher's files): replaced by the test's own.
DROPPED = ("--port=", "--autoscaling-config=")

pytestmark = pytest.mark.slow

NICENESS_PROBE = """
import os, sys, ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
ray.init(address=sys.argv[1], log_to_driver=False)
niceness = ray.remote(num_cpus=1)(lambda: os.nice(0))
nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
on = [niceness.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote() for node in nodes]
print(",".join(str(value) for value in ray.get(on)))
"""


def node_env(home: Path, with_auth_mode: bool = True) -> dict[str, str]:
    """A fresh node's environment: its own HOME, none of this process's Ray settings."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS" and not k.startswith("RAY_AUTH")}
    env.update(HOME=str(home), PATH=f"{BIN}:{env.get('PATH', '')}")
    return env


def start_segment(commands: list[str]) -> str:
    """The `ray start ...` command of a *_start_ray_commands list (`ray stop` skipped)."""
    (command,) = [c for c in commands if "ray start" in c]
    (segment,) = [s.strip() for s in command.split(";") if "ray start" in s]
    return segment


def as_test_node(segment: str, cluster: PlayedCluster, is_head: bool, gcs_address: str = "") -> tuple[str, dict[str, int]]:
    words = [w for w in shlex.split(segment) if not w.startswith(DROPPED)]
    if not is_head:
        words = [f"--address={gcs_address}" if w.startswith("--address=") else w for w in words]
    ports = cluster.node_ports(is_head)
    words += ["--block", f"--temp-dir={cluster.temp_dir}", "--num-cpus=1", *(f"--{f}={p}" for f, p in ports.items())]
    return shlex.join(words), ports


def start(cluster: PlayedCluster, command: str, env: dict[str, str]) -> None:
    log = open(Path(cluster.temp_dir) / f"ray-start-{len(cluster.processes)}.log", "w")
    # `bash -c` runs it as the launcher's shell would: the RAY_AUTH_MODE=token prefix included.
    cluster.processes.append(subprocess.Popen(["bash", "-c", command], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))


def test_the_yaml_commands_make_an_authenticated_cluster(tmp_path):
    config = yaml.safe_load(CONFIG.read_text())
    head_home, worker_home, stranger_home = tmp_path / "head", tmp_path / "worker", tmp_path / "stranger"
    for home in (head_home, worker_home, stranger_home):
        home.mkdir()
    # The head's setup: the token (the pip install of the repository is this checkout already).
    for command in config["head_setup_commands"]:
        subprocess.run(["bash", "-c", command], env=node_env(head_home), check=True, timeout=120)
    # The autoscaler's sync, head -> worker, of each cluster_synced_files path.
    for path in config["cluster_synced_files"]:
        source = Path(path.replace("~", str(head_home), 1))
        target = Path(path.replace("~", str(worker_home), 1))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    token = (head_home / ".ray" / "auth_token").read_text().strip()
    assert len(token) == 64 and oct((head_home / ".ray" / "auth_token").stat().st_mode & 0o777) == "0o600"

    cluster = PlayedCluster(temp_dir=tempfile.mkdtemp(prefix="psy", dir="/tmp"), auth_mode="token", auth_token=token)
    try:
        head, ports = as_test_node(start_segment(config["head_start_ray_commands"]), cluster, is_head=True)
        assert start_environment(head) == {"RAY_AUTH_MODE": "token", "RAY_worker_niceness": "0"} and " ray start --head" in head
        start(cluster, head, node_env(head_home))
        cluster.dashboard_url = f"http://127.0.0.1:{ports['dashboard-port']}"
        gcs = f"127.0.0.1:{ports['port']}"
        wait_for(lambda: cluster.node_count() == 1, 180, "head up", cluster)
        worker, _ = as_test_node(start_segment(config["worker_start_ray_commands"]), cluster, is_head=False, gcs_address=gcs)
        start(cluster, worker, node_env(worker_home))
        wait_for(lambda: cluster.node_count() == 2, 180, "the worker joined with the synced token", cluster)
        # A driver with the token runs a task on each node: Ray started it at the niceness of the
        # `ray start` that made the node (this process's), not 15 above it.
        probe = subprocess.run(
            [sys.executable, "-c", NICENESS_PROBE, gcs], env={**node_env(head_home), "RAY_AUTH_MODE": "token"}, capture_output=True, text=True, timeout=180
        )
        assert probe.returncode == 0, probe.stdout + probe.stderr
        assert probe.stdout.split()[-1] == f"{os.nice(0)},{os.nice(0)}", probe.stdout

        # The dashboard (and its job and Serve REST API) listens on loopback only, and wants the token.
        listening = [c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == ports["dashboard-port"]]
        assert listening and set(listening) <= {"127.0.0.1"}, listening
        assert requests.get(f"{cluster.dashboard_url}/api/jobs/", timeout=10).status_code == 401
        # A node without the token cannot join, whether or not it asks for token mode.
        for with_mode in (True, False):
            stranger, _ = as_test_node(start_segment(config["worker_start_ray_commands"]), cluster, is_head=False, gcs_address=gcs)
            stranger = stranger.replace(" --block", "")
            if not with_mode:
                stranger = stranger.replace("RAY_AUTH_MODE=token ", "")
            result = subprocess.run(["bash", "-c", stranger], env=node_env(stranger_home), capture_output=True, text=True, timeout=120)
            assert result.returncode != 0 and "auth" in result.stderr.lower() + result.stdout.lower(), result.stdout + result.stderr
        assert cluster.node_count() == 2
    finally:
        cluster.tear_down()
        shutil.rmtree(cluster.temp_dir, ignore_errors=True)
