"""Scaling is light: the LLMServer's replica count changes through Ray Serve's REST API (`PUT
/api/serve/applications/`, what KubeRay does with serveConfigV2) without restarting the replicas
that stay: they keep their process and their engine (its counters, its KV cache)."""

from __future__ import annotations

import pytest
import requests

from pagedserve.cluster.server_config import AutoscalingConfig, DeploymentConfig, ServerConfig
from tests.cluster.conftest import metric_per_replica, wait_until

APP = "scaly"


class ServeRestApi:
    """The dashboard's Serve REST API, as KubeRay calls it (with the cluster's auth token)."""

    def __init__(self, ray_cluster, serve_url: str):
        from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
        from ray._private.worker import get_dashboard_url

        self.url = f"http://{get_dashboard_url()}/api/serve/applications/"
        self.headers = get_auth_headers_if_auth_enabled({})
        host, port = serve_url.removeprefix("http://").split(":")
        self.http_options = {"host": host, "port": int(port)}

    def put(self, application: dict) -> None:
        config = {"http_options": self.http_options, "applications": [application]}
        response = requests.put(self.url, json=config, headers=self.headers, timeout=60)
        assert response.status_code == 200, response.text

    def replica_pids(self) -> list[int] | None:
        """The LLMServer's replicas' pids once the app is RUNNING with every replica RUNNING."""
        details = requests.get(self.url, headers=self.headers, timeout=10).json()["applications"].get(APP)
        if details is None or details["status"] != "RUNNING":
            return None
        replicas = details["deployments"]["LLMServer"]["replicas"]
        if not all(replica["state"] == "RUNNING" and replica.get("pid") for replica in replicas):
            return None
        return sorted(replica["pid"] for replica in replicas)

    def wait_for_replicas(self, count: int) -> list[int]:
        pids = lambda: (found := self.replica_pids()) is not None and len(found) == count and found  # noqa: E731
        return wait_until(pids, timeout=240, interval=0.5, what=f"{count} running LLMServer replica(s)")

    def delete_all(self) -> None:
        # An empty declarative config deletes the apps the REST API deployed (and only those).
        requests.put(self.url, json={"http_options": self.http_options, "applications": []}, headers=self.headers, timeout=60)


def generation_tokens(base_url: str) -> dict[str, float]:
    """Each replica's engine counter of generated tokens (it starts at 0 with the engine)."""
    return metric_per_replica(base_url, "pagedserve:generation_tokens_total")


def complete(base_url: str) -> dict:
    body = {"model": APP, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    response = requests.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def rest_api(ray_cluster, serve_url):
    api = ServeRestApi(ray_cluster, serve_url)
    yield api
    api.delete_all()


def test_the_override_scales_without_restarting_the_replicas_that_stay(rest_api, serve_url, model_dirs):
    from pagedserve.cluster.app import serve_application_config

    base_url = f"{serve_url}/{APP}"
    config = ServerConfig(model=str(model_dirs["llama"]), served_model_name=APP, engine={"max_model_len": 256})

    def deploy(num_replicas: int) -> None:
        scaled = config.model_copy(update={"deployment": DeploymentConfig(num_replicas=num_replicas)})
        application = serve_application_config(scaled, APP, f"/{APP}")
        assert "num_replicas" not in application["args"].get("deployment", {})  # args stay the same
        rest_api.put(application)

    deploy(1)
    [first_pid] = rest_api.wait_for_replicas(1)
    expected = complete(base_url)["choices"][0]["text"]
    counters = wait_until(lambda: (found := generation_tokens(base_url)) and sum(found.values()) >= 8 and found, 30, 0.2)
    [(first_replica, tokens_before)] = counters.items()

    deploy(2)
    pids = rest_api.wait_for_replicas(2)
    assert first_pid in pids, (first_pid, pids)
    # The engine that stayed is the same one: its counters did not start over.
    assert wait_until(lambda: generation_tokens(base_url).get(first_replica), 30, 0.2) >= tokens_before
    for _ in range(4):  # whichever replica answers: the same (greedy) text
        assert complete(base_url)["choices"][0]["text"] == expected

    deploy(1)
    [last_pid] = rest_api.wait_for_replicas(1)
    assert last_pid in pids, (last_pid, pids)  # a replica that stayed, not a new one
    assert complete(base_url)["choices"][0]["text"] == expected


def test_the_application_config_puts_the_scale_in_the_override():
    """The same args for every replica count and autoscaling setting: a scale change never
    changes Serve's code version (the hash of import path, runtime env and args)."""
    from pagedserve.cluster.app import serve_application_config

    def application(**deployment) -> dict:
        config = ServerConfig(model="tiny", engine={"max_model_len": 256}, deployment=DeploymentConfig(max_ongoing_requests=64, **deployment))
        return serve_application_config(config, "app")

    fixed, scaled, autoscaled = application(num_replicas=1), application(num_replicas=3), application(autoscaling=AutoscalingConfig(max_replicas=5))
    assert fixed["args"] == scaled["args"] == autoscaled["args"]
    assert fixed["args"]["deployment"] == {"max_ongoing_requests": 64}
    assert scaled["deployments"] == [{"name": "LLMServer", "num_replicas": 3}]
    [override] = autoscaled["deployments"]
    assert override["autoscaling_config"]["max_replicas"] == 5
    assert override["autoscaling_config"]["policy"]["policy_function"] == "pagedserve.cluster.autoscaling:EngineLoadPolicy"


def test_placement_is_checked_per_replica(ray_cluster):
    """Three replicas of a TP=2 CPU engine need 9 CPU slots and the test cluster has 8: the
    app still deploys (one replica fits; the rest wait for the cluster to grow), while an
    engine that no replica could hold is refused."""
    from pagedserve.cluster.app import place_workers

    config, bundles = place_workers(ServerConfig(engine={"tensor_parallel_size": 2}, deployment=DeploymentConfig(num_replicas=3)))
    assert bundles == [{"CPU": 1}, {"CPU": 1}] and config.engine["distributed_executor_backend"] == "ray"
    autoscaled = ServerConfig(engine={"tensor_parallel_size": 2}, deployment=DeploymentConfig(autoscaling=AutoscalingConfig(min_replicas=3, max_replicas=6)))
    assert place_workers(autoscaled)[1] == bundles
    with pytest.raises(ValueError, match="8 per replica needs 9 CPUs but the Ray cluster has 8"):
        place_workers(ServerConfig(engine={"tensor_parallel_size": 8}))


def test_the_serve_config_scales_in_the_override():
    """configs/serve.yaml keeps the replica count out of `args` (editing it there would restart
    every engine) and in the LLMServer's `deployments:` entry."""
    from pathlib import Path

    import yaml

    [app] = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "serve.yaml").read_text())["applications"]
    assert not {"num_replicas", "autoscaling", "autoscaling_config"} & set(app["args"].get("deployment", {}))
    assert app["deployments"] == [{"name": "LLMServer", "num_replicas": 1}]
