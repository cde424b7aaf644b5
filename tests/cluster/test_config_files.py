"""Every YAML under configs/ loads and validates: server settings against ServerConfig, the Serve
config against Serve's own schema (and its app args against ServerConfig), cluster launcher
configs against Ray's autoscaler schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pagedserve.cluster.server_config import ServerConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
ALL_YAML = sorted(CONFIGS.rglob("*.yaml"))


def kind_of(path: Path) -> str:
    if path.name.startswith("cluster-"):
        return "cluster"
    return "serve" if path.name == "serve.yaml" else "server"


def test_every_config_is_covered():
    names = {p.relative_to(CONFIGS).as_posix() for p in ALL_YAML}
    assert {"local.yaml", "serve.yaml", "cluster-local.yaml", "cluster-aws.yaml"} <= names
    assert any(name.startswith("models/") for name in names)


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_config_is_valid(path: Path):
    data = yaml.safe_load(path.read_text())
    kind = kind_of(path)
    if kind == "server":
        ServerConfig.load(path)
    elif kind == "serve":
        from ray.serve.schema import ServeDeploySchema

        schema = ServeDeploySchema.model_validate(data) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(data)
        for app in schema.applications:
            assert app.import_path == "pagedserve.cluster.app:build_app"
            ServerConfig.load(overrides=app.args)
    else:
        validate_cluster_config(data)


def validate_cluster_config(data: dict) -> None:
    import jsonschema
    import ray

    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(data, schema)
    assert any("ray start --head" in command for command in data["head_start_ray_commands"])
    assert any("constraints.txt" in command for command in data["setup_commands"])


@pytest.mark.parametrize("name", ["cluster-local.yaml", "cluster-aws.yaml"])
def test_cluster_yaml_starts_ray_workers_at_the_raylets_niceness(name):
    """Ray would start the replicas and the engine at nice 15 (pagedserve/ray_env.py says why not);
    test_cluster_yaml_auth runs the local YAML's commands and finds its workers at nice 0."""
    from tests.cluster.test_config_security import ray_starts, start_environment

    starts = ray_starts(yaml.safe_load((CONFIGS / name).read_text()))
    assert len(starts) == 2 and all(start_environment(s).get("RAY_worker_niceness") == "0" for s in starts), starts


def test_aws_cluster_has_a_gpu_worker_type():
    data = yaml.safe_load((CONFIGS / "cluster-aws.yaml").read_text())
    gpu_types = [name for name, node in data["available_node_types"].items() if node["resources"].get("GPU", 0) >= 1]
    assert gpu_types and data["available_node_types"][gpu_types[0]]["max_workers"] >= 1


def test_local_yaml_is_the_built_in_default():
    assert ServerConfig.load(CONFIGS / "local.yaml") == ServerConfig()


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("bogus: 1\n", "unknown setting 'bogus'"),
        ("engine: {max_model_len: -5}\n", "max_model_len"),
        ("engine: {tensor_parallel_size: two}\n", "tensor_parallel_size"),
        ("deployment: {num_replicas: 0}\n", "deployment.num_replicas"),
        ("engine: {model: x}\n", "top level"),
        ("port: 99999\n", "port"),
        ("- just a list\n", "mapping"),
    ],
)
def test_bad_config_names_the_key(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=fragment):
        ServerConfig.load(path)


def test_flags_override_the_file(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text("port: 9000\nengine: {max_model_len: 128, block_size: 8}\ndeployment: {num_replicas: 2}\n")
    config = ServerConfig.load(path, {"port": 9001, "max_model_len": 256, "max_queued_requests": 10})
    assert config.port == 9001 and config.engine == {"max_model_len": 256, "block_size": 8}
    assert (config.deployment.num_replicas, config.deployment.max_queued_requests) == (2, 10)


def test_the_servers_reasoning_parser_tells_the_engine_where_a_grammar_starts():
    assert ServerConfig(reasoning_parser="qwen3").engine_config().reasoning_parser == "qwen3"
    assert ServerConfig().engine_config().reasoning_parser is None
    # Set under engine: too, the engine's own setting stands.
    assert ServerConfig(reasoning_parser="qwen3", engine={"reasoning_parser": "deepseek_r1"}).engine_config().reasoning_parser == "deepseek_r1"


def test_parallelism_beyond_the_cluster_is_refused_before_any_actor(ray_cluster):
    from pagedserve.cluster.app import place_workers

    config = ServerConfig(engine={"tensor_parallel_size": 4, "pipeline_parallel_size": 4})
    with pytest.raises(ValueError, match="needs 17 CPUs but the Ray cluster has 8"):
        place_workers(config)
    with pytest.raises(ValueError, match="needs 2 GPUs but the Ray cluster has 0"):
        place_workers(ServerConfig(engine={"device": "cuda", "tensor_parallel_size": 2}))
