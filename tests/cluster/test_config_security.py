"""Every config file we ship is safe as shipped: Ray clusters from our launcher YAML run with
token authentication (the head makes the token, the workers get it) and a dashboard on loopback;
a Serve config that listens on every interface requires an API key from a file; no file holds a
key in plain text; the Helm chart's values never expose the server without a key nor Ray without
its token. Each check is also run against the unsafe form it exists to catch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pagedserve.cluster.server_config import ServerConfig, is_loopback

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
CHART = REPO / "helm" / "pagedserve"
CLUSTER_YAML = sorted(CONFIGS.glob("cluster-*.yaml"))
SERVE_YAML = CONFIGS / "serve.yaml"
SERVER_YAML = [p for p in sorted(CONFIGS.rglob("*.yaml")) if p not in CLUSTER_YAML and p != SERVE_YAML]
HELM_VALUES = [CHART / "values.yaml", *sorted((CHART / "ci").glob("*-values.yaml"))]
TOKEN_FILE = "~/.ray/auth_token"


def commands_of(node) -> list[str]:
    """Every shell command in a launcher config: any `*_commands` list, at any depth."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key.endswith("_commands") and isinstance(value, list):
                found += [str(command) for command in value]
            else:
                found += commands_of(value)
    elif isinstance(node, list):
        for value in node:
            found += commands_of(value)
    return found


def ray_starts(data: dict) -> list[str]:
    """Each `ray start ...` shell segment of a launcher config, with its environment prefix."""
    return [segment.strip() for command in commands_of(data) for segment in re.split(r";|&&|\|\|", command) if "ray start" in segment]


def start_environment(segment: str) -> dict[str, str]:
    """The `NAME=value` assignments a `ray start` segment begins with (its process's environment)."""
    prefix = segment[: segment.index("ray start")].split()
    assert all(re.fullmatch(r"[A-Za-z_]\w*=\S*", word) for word in prefix), f"not an environment prefix: {segment!r}"
    return dict(word.split("=", 1) for word in prefix)


def check_cluster_auth(data: dict) -> None:
    """Raises AssertionError naming the first rule a cluster launcher config breaks."""
    starts = ray_starts(data)
    assert any("--head" in s for s in starts) and any("--address" in s for s in starts), "a head and a worker `ray start`"
    for segment in starts:
        assert start_environment(segment).get("RAY_AUTH_MODE") == "token", f"ray start without token auth: {segment!r}"
        for host in re.findall(r"--dashboard-host[= ](\S+)", segment):
            assert is_loopback(host), f"dashboard on a public interface: {segment!r}"
    head_setup = data.get("head_setup_commands", [])
    assert any("ray get-auth-token --generate" in command for command in head_setup), "the head must generate the token"
    synced = set(data.get("cluster_synced_files", [])) | set(data.get("file_mounts", {}))
    assert TOKEN_FILE in synced, f"{TOKEN_FILE} must reach the workers (cluster_synced_files)"


def check_serve_config(data: dict) -> None:
    host = (data.get("http_options") or {}).get("host", "127.0.0.1")
    for app in data["applications"]:
        args = app.get("args") or {}
        assert "api_key" not in args, f"application {app['name']}: a key in plain text"
        if not is_loopback(host):
            assert args.get("api_key_file"), f"application {app['name']} listens on {host} with no api_key_file"


def check_helm_values(values: dict) -> None:
    exposed = values.get("ingress", {}).get("enabled") or values.get("service", {}).get("type") in ("NodePort", "LoadBalancer")
    if exposed:
        assert values.get("apiKey", {}).get("secretName"), "the server is exposed with no apiKey.secretName"
    auth = values.get("rayAuth", {})
    assert auth.get("mode") == "token" or auth.get("allowUnauthenticated") is True, "Ray without token auth"
    assert not (values.get("server") or {}).get("api_key"), "a key in plain text"


def merged(defaults: dict, given: dict) -> dict:
    out = dict(defaults)
    for key, value in given.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def test_every_shipped_config_is_checked():
    assert {p.name for p in CLUSTER_YAML} == {"cluster-local.yaml", "cluster-aws.yaml"}
    assert SERVE_YAML.exists() and any(p.name == "local.yaml" for p in SERVER_YAML)
    assert len(HELM_VALUES) >= 5


@pytest.mark.parametrize("path", CLUSTER_YAML, ids=lambda p: p.name)
def test_cluster_yaml_starts_ray_with_token_auth(path):
    data = yaml.safe_load(path.read_text())
    check_cluster_auth(data)
    # The key serve.yaml requires is shipped to every node, as the code is.
    key_file = yaml.safe_load(SERVE_YAML.read_text())["applications"][0]["args"]["api_key_file"]
    assert key_file in data["file_mounts"]


def test_serve_yaml_listens_publicly_only_with_a_key_file():
    data = yaml.safe_load(SERVE_YAML.read_text())
    check_serve_config(data)
    assert not is_loopback(data["http_options"]["host"])  # as shipped: public, so the key is what is checked


@pytest.mark.parametrize("path", SERVER_YAML, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_server_yaml_has_no_plain_key_and_validates(path):
    data = yaml.safe_load(path.read_text()) or {}
    assert not data.get("api_key"), "a key in plain text"
    ServerConfig.load(path)  # a public host with no key is refused here (test_public_host_needs_a_key)


@pytest.mark.parametrize("path", HELM_VALUES, ids=lambda p: p.name)
def test_helm_values_are_safe(path):
    defaults = yaml.safe_load(HELM_VALUES[0].read_text())
    check_helm_values(merged(defaults, yaml.safe_load(path.read_text()) or {}))


UNSAFE_CLUSTERS = [
    pytest.param({"head_start_ray_commands": ["ray start --head --port=6379"], "worker_start_ray_commands": ["RAY_AUTH_MODE=token ray start --address=h:6379"],
                  "head_setup_commands": ["ray get-auth-token --generate"], "cluster_synced_files": [TOKEN_FILE]}, "without token auth", id="head-open"),
    pytest.param({"head_start_ray_commands": ["RAY_worker_niceness=0 RAY_AUTH_MODE=disabled ray start --head"], "worker_start_ray_commands": ["RAY_AUTH_MODE=token ray start --address=h:6379"],
                  "head_setup_commands": ["ray get-auth-token --generate"], "cluster_synced_files": [TOKEN_FILE]}, "without token auth", id="head-mode-disabled"),
    pytest.param({"head_start_ray_commands": ["RAY_AUTH_MODE=token ray start --head"], "worker_start_ray_commands": ["ulimit -n 65536; ray start --address=h:6379"],
                  "head_setup_commands": ["ray get-auth-token --generate"], "cluster_synced_files": [TOKEN_FILE]}, "without token auth", id="worker-open"),
    pytest.param({"head_start_ray_commands": ["RAY_AUTH_MODE=token ray start --head --dashboard-host=0.0.0.0"], "worker_start_ray_commands": ["RAY_AUTH_MODE=token ray start --address=h:6379"],
                  "head_setup_commands": ["ray get-auth-token --generate"], "cluster_synced_files": [TOKEN_FILE]}, "public interface", id="public-dashboard"),
    pytest.param({"head_start_ray_commands": ["RAY_AUTH_MODE=token ray start --head"], "worker_start_ray_commands": ["RAY_AUTH_MODE=token ray start --address=h:6379"],
                  "cluster_synced_files": [TOKEN_FILE]}, "generate the token", id="no-token-made"),
    pytest.param({"head_start_ray_commands": ["RAY_AUTH_MODE=token ray start --head"], "worker_start_ray_commands": ["RAY_AUTH_MODE=token ray start --address=h:6379"],
                  "head_setup_commands": ["ray get-auth-token --generate"]}, "reach the workers", id="token-not-synced"),
]


@pytest.mark.parametrize("data, message", UNSAFE_CLUSTERS)
def test_cluster_check_catches(data, message):
    with pytest.raises(AssertionError, match=message):
        check_cluster_auth(data)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"http_options": {"host": "0.0.0.0"}, "applications": [{"name": "a", "args": {"model": "demo"}}]}, "no api_key_file"),
        ({"http_options": {"host": "127.0.0.1"}, "applications": [{"name": "a", "args": {"api_key": "sk-1"}}]}, "plain text"),
    ],
    ids=["public-no-key", "plain-key"],
)
def test_serve_check_catches(data, message):
    with pytest.raises(AssertionError, match=message):
        check_serve_config(data)
    check_serve_config({"http_options": {"host": "127.0.0.1"}, "applications": [{"name": "a", "args": {}}]})


@pytest.mark.parametrize(
    "values, message",
    [
        ({"ingress": {"enabled": True}, "apiKey": {"secretName": ""}, "rayAuth": {"mode": "token"}}, "no apiKey.secretName"),
        ({"service": {"type": "LoadBalancer"}, "apiKey": {"secretName": ""}, "rayAuth": {"mode": "token"}}, "no apiKey.secretName"),
        ({"rayAuth": {"mode": "disabled"}}, "Ray without token auth"),
    ],
    ids=["ingress-no-key", "load-balancer-no-key", "ray-auth-off"],
)
def test_helm_values_check_catches(values, message):
    with pytest.raises(AssertionError, match=message):
        check_helm_values(values)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "my-host.example.com"])
def test_public_host_needs_a_key(host, tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match=f"host '{re.escape(host)}' accepts connections from other machines, but no API key is set") as error:
        ServerConfig.load(overrides={"host": host})
    assert "--api-key-file" in str(error.value) and "--allow-unauthenticated" in str(error.value)
    path = tmp_path / "server.yaml"
    path.write_text(f"host: '{host}'\n")
    with pytest.raises(ValueError, match="no API key is set"):
        ServerConfig.load(path)
    # Any way of giving a key, or saying so explicitly, is accepted.
    ServerConfig.load(path, {"api_key_file": str(tmp_path / "key")})
    ServerConfig.load(path, {"api_key": "sk-1"})
    ServerConfig.load(path, {"allow_unauthenticated": True})
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "sk-2")
    ServerConfig.load(path)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_host_needs_no_key(host, monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    assert ServerConfig.load(overrides={"host": host}).host == host
