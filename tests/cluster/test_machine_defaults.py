"""`pagedserve serve` on a local Ray cluster it started: a lone CPU engine replica gets every core
(launcher.machine_defaults); everything else keeps its one-CPU reservation."""

from __future__ import annotations

import pytest

from pagedserve.cluster.launcher import (
    SERVE_CONTROL_LOOP_INTERVAL_S,
    SERVE_CONTROL_LOOP_VARIABLE,
    SERVER_CPU_KV_CACHE_MAX_BYTES,
    machine_defaults,
    server_cpu_kv_cache_bytes,
    slow_serve_control_loop,
)
from pagedserve.cluster.server_config import SERVER_CPU_MAX_NUM_SEQS, SERVER_CPU_MIN_NUM_BATCHED_TOKENS, ServerConfig
from pagedserve.config import EngineConfig

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


def test_light_steps_leave_a_core_to_serve_where_the_engine_runs_in_a_replica():
    replicas = ServerConfig(engine_host="replicas")
    assert machine_defaults(replicas, TWO_CORES).engine["light_step_cpu_threads"] == 1
    assert machine_defaults(replicas, {"CPU": 8.0}).engine["light_step_cpu_threads"] == 7
    said = ServerConfig(engine_host="replicas", engine={"light_step_cpu_threads": 2})
    assert machine_defaults(said, TWO_CORES).engine["light_step_cpu_threads"] == 2
    assert "light_step_cpu_threads" not in machine_defaults(replicas, {"CPU": 1.0}).engine


def test_every_step_takes_every_core_where_the_engine_runs_in_the_ingress():
    engine = machine_defaults(ServerConfig(engine_host="ingress"), TWO_CORES).engine
    assert "light_step_cpu_threads" not in engine and engine["engine_core_process"] is True
    said = ServerConfig(engine_host="ingress", engine={"light_step_cpu_threads": 1})
    assert machine_defaults(said, TWO_CORES).engine["light_step_cpu_threads"] == 1


def test_the_engine_core_gets_its_own_process_unless_said_otherwise():
    assert machine_defaults(ServerConfig(), TWO_CORES).engine["engine_core_process"] is True
    said = ServerConfig(engine={"engine_core_process": False})
    assert machine_defaults(said, TWO_CORES).engine["engine_core_process"] is False
    assert "engine_core_process" not in machine_defaults(ServerConfig(deployment={"num_replicas": 2}), TWO_CORES).engine


def test_a_lone_cpu_replica_gets_a_kv_cache_sized_by_the_machine_unless_told():
    assert server_cpu_kv_cache_bytes(24 * 2**30) == 3 * 2**30  # an eighth
    assert server_cpu_kv_cache_bytes(128 * 2**30) == SERVER_CPU_KV_CACHE_MAX_BYTES
    assert machine_defaults(ServerConfig(), TWO_CORES).engine["kv_cache_memory_bytes"] == server_cpu_kv_cache_bytes()
    said = ServerConfig(engine={"kv_cache_memory_bytes": 2**20})
    assert machine_defaults(said, TWO_CORES).engine["kv_cache_memory_bytes"] == 2**20
    assert "kv_cache_memory_bytes" not in machine_defaults(ServerConfig(deployment={"num_replicas": 2}), TWO_CORES).engine


@pytest.mark.parametrize(
    "engine, has_gpu, expected",
    [
        ({}, False, SERVER_CPU_MAX_NUM_SEQS),  # device auto, no GPU in the replica: the CPU cap
        ({"device": "cpu"}, True, SERVER_CPU_MAX_NUM_SEQS),
        ({}, True, EngineConfig.model_fields["max_num_seqs"].default),  # a GPU keeps the engine's
        ({"device": "cuda"}, False, EngineConfig.model_fields["max_num_seqs"].default),  # its workers hold the GPUs
        ({"max_num_seqs": 256}, False, 256),  # said by the user: kept, even when it is the default
        ({"max_num_seqs": 32, "device": "cpu"}, False, 32),
    ],
    ids=["cpu-auto", "cpu-explicit", "gpu", "cuda-workers", "user-256", "user-32"],
)
def test_a_cpu_replica_caps_its_batch_unless_told(engine, has_gpu, expected):
    config = ServerConfig(engine=engine)
    assert config.replica_engine_config(has_gpu=has_gpu).max_num_seqs == expected
    assert config.engine_config().max_num_seqs == engine.get("max_num_seqs", 256)  # offline and the driver: unchanged


@pytest.mark.parametrize(
    "engine, has_gpu, expected",
    [
        ({}, False, SERVER_CPU_MIN_NUM_BATCHED_TOKENS),  # a CPU replica: short steps while few requests run
        ({}, True, None),  # a GPU: every step the full budget
        ({"min_num_batched_tokens": 1024}, False, 1024),  # said by the user: kept
        ({"max_num_batched_tokens": 64}, False, 64),  # never above the budget
        ({"enable_chunked_prefill": False}, False, None),  # a whole prompt must fit in every step
    ],
    ids=["cpu", "gpu", "user", "small-budget", "no-chunking"],
)
def test_a_cpu_replica_takes_short_steps_while_few_requests_run(engine, has_gpu, expected):
    config = ServerConfig(engine=engine)
    assert config.replica_engine_config(has_gpu=has_gpu).min_num_batched_tokens == expected
    assert config.engine_config().min_num_batched_tokens == engine.get("min_num_batched_tokens")  # offline: unchanged


def test_serve_control_loop_slows_unless_the_environment_says_otherwise():
    environ: dict[str, str] = {}
    slow_serve_control_loop(environ)
    assert float(environ[SERVE_CONTROL_LOOP_VARIABLE]) == SERVE_CONTROL_LOOP_INTERVAL_S > 0.1  # Serve's default: 0.1
    environ = {SERVE_CONTROL_LOOP_VARIABLE: "0.2"}
    slow_serve_control_loop(environ)
    assert environ == {SERVE_CONTROL_LOOP_VARIABLE: "0.2"}
