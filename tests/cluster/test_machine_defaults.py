"""`pagedserve serve` on a local Ray cluster it started: a lone CPU engine replica gets every core
(launcher.machine_defaults); everything else keeps its one-CPU reservation."""

from __future__ import annotations

import pytest

from pagedserve.cluster.launcher import machine_defaults
from pagedserve.cluster.server_config import ServerConfig

TWO_CORES = {"CPU": 2.0}


def test_a_lone_cpu_replica_gets_every_core():
    config = machine_defaults(ServerConfig(), TWO_CORES)
    assert config.deployment.num_cpus == 2.0
    assert config.model == ServerConfig().model  # nothing else changes but the engine's CPU defaults


@pytest.mark.parametrize(
    "kwargs",
    [
        {"deployment": {"num_cpus": 1}},  # said by the user: kept, even when it equals the default
        {"deployment": {"num_replicas": 2}},
        {"deployment": {"autoscaling": {"max_replicas": 3}}},
        {"engine": {"tensor_parallel_size": 2}},
        {"engine": {"device": "cuda"}},
    ],
    ids=["explicit", "replicas", "autoscaling", "tp", "cuda"],
)
def test_other_setups_keep_one_cpu(kwargs):
    config = ServerConfig(**kwargs)
    assert machine_defaults(config, TWO_CORES).deployment.num_cpus == config.deployment.num_cpus


def test_a_gpu_node_keeps_one_cpu():
    assert machine_defaults(ServerConfig(), {"CPU": 16.0, "GPU": 1.0}).deployment.num_cpus == 1.0


def test_light_steps_leave_a_core_to_serve():
    assert machine_defaults(ServerConfig(), TWO_CORES).engine["light_step_cpu_threads"] == 1
    assert machine_defaults(ServerConfig(), {"CPU": 8.0}).engine["light_step_cpu_threads"] == 7
    said = ServerConfig(engine={"light_step_cpu_threads": 2})
    assert machine_defaults(said, TWO_CORES).engine["light_step_cpu_threads"] == 2
    assert "light_step_cpu_threads" not in machine_defaults(ServerConfig(), {"CPU": 1.0}).engine


def test_the_engine_core_gets_its_own_process_unless_said_otherwise():
    assert machine_defaults(ServerConfig(), TWO_CORES).engine["engine_core_process"] is True
    said = ServerConfig(engine={"engine_core_process": False})
    assert machine_defaults(said, TWO_CORES).engine["engine_core_process"] is False
    assert "engine_core_process" not in machine_defaults(ServerConfig(deployment={"num_replicas": 2}), TWO_CORES).engine
