"""The Serve application: OpenAI ingress -> LLMServer (one AsyncLLM per replica), plus the
metrics hub (every replica's statistics for /metrics, one series per replica).

`build_app` is the Serve config's `import_path` (`pagedserve.cluster.app:build_app`): Serve calls
it with the config's `args`, which are `ServerConfig` fields (engine arguments under `engine:` or
flat). The LLMServer replicas get a placement group each, laid out here and only here: bundle 0
for the replica (`deployment.num_cpus`, default one CPU), then one bundle per TP x PP rank (a GPU each on a GPU cluster), whose
indices the replica hands down to its executor. A CPU-only, single-rank engine runs in the
replica itself. With `engine_host: ingress` there is no LLMServer deployment: the one ingress
replica builds the LLMServer in its own process (cluster/local_engine.py) and takes the
reservation and placement group an engine replica would have had; the metrics hub is an object
in that process too, not a deployment.
"""

from __future__ import annotations

import os
from typing import Any

from pagedserve.cluster.server_config import SERVE_DIRECT_INGRESS_VARIABLE, DeploymentConfig, ServerConfig

# Streams hold an ingress slot for their whole life; Serve's default (5) would queue requests at
# the ingress long before the engine is busy. Admission control is the LLMServer's job.
INGRESS_MAX_ONGOING_REQUESTS = 10_000
# A `serve deploy` that changes the app's args replaces every deployment, the ingress too (Serve
# hashes the args into the code version), and an ingress replica holds its clients' connections:
# a stopping one takes no new requests (the proxies route to its successor) but its streams,
# which move from engine replica to engine replica meanwhile (handover.py), must end before it
# may. Serve's default grace (20 s) cut them; this only bounds the wait, for it exits as soon as
# its last stream ends. A Serve config's `deployments:` override of OpenAIIngress changes it.
INGRESS_GRACEFUL_SHUTDOWN_S = 600.0
INGRESS_SHUTDOWN_POLL_S = 0.5  # how often a stopping ingress checks whether its streams ended
# The new ingress replica starts before the old one stops (it needs no resources), so there is
# no moment without one and new requests never wait for it.
INGRESS_MAX_SURGE_PERCENT = 100

IMPORT_PATH = "pagedserve.cluster.app:build_app"
SERVER_DEPLOYMENT = "LLMServer"
# The Helm chart keeps these two off the head pod by name (its serveConfigV2 `deployments:`).
INGRESS_DEPLOYMENT = "OpenAIIngress"
HUB_DEPLOYMENT = "MetricsHub"
SCALE_FIELDS = ("num_replicas", "autoscaling", "autoscaling_config")  # DeploymentConfig's; see serve_application_config


def build_app(args: dict[str, Any] | ServerConfig | None = None) -> Any:
    """The application; `engine_host` 'auto' means 'replicas' here (a Serve config's
    `deployments:` override may scale the LLMServer later); `pagedserve serve` decides it first."""
    from ray import serve

    from pagedserve.cluster.ingress import key_digest
    from pagedserve.cluster.metrics_hub import MetricsHub
    from pagedserve.cluster.openai_serving import RequestLimits

    config = args if isinstance(args, ServerConfig) else ServerConfig.load(overrides=args or {})
    if config.http_ingress == "direct" and os.environ.get(SERVE_DIRECT_INGRESS_VARIABLE) != "1":
        raise ValueError(
            f"http_ingress 'direct' needs Serve's direct ingress ({SERVE_DIRECT_INGRESS_VARIABLE}=1 in every Ray process's "
            "environment), which `pagedserve serve` sets up on a Ray cluster it starts; this cluster lacks it: use 'auto' or 'proxy'"
        )
    api_key = config.resolve_api_key()  # before anything starts: a missing key file stops us here
    # The key itself never goes into a deployment's arguments (which Serve records and shows).
    config = config.model_copy(update={"api_key": None, "api_key_file": None})
    config, worker_bundles = place_workers(config)
    worker_bundle_indices = tuple(range(1, 1 + len(worker_bundles)))  # bundle 0 holds the engine's host

    # A replica needs no deployment options (Serve applies them), and its arguments must not
    # depend on the deployment's scale.
    replica_config = config.model_copy(update={"deployment": DeploymentConfig()})
    if config.engine_host == "ingress":  # local_engine.py: the ingress holds the engine, its resources and the hub
        servers, local_engine, hub = {}, (replica_config, worker_bundle_indices), None
        ingress = _ingress_deployment(config, _engine_resources(config, worker_bundles))
    else:
        hub = serve.deployment(
            MetricsHub, name=HUB_DEPLOYMENT, num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0}
        ).bind()
        server = _server_deployment(config, worker_bundles).bind(replica_config, hub, worker_bundle_indices)
        servers, local_engine = {config.model_name: server}, None
        ingress = _ingress_deployment(config)
    engine = config.engine_config()
    limits = {config.model_name: RequestLimits(max_n=engine.max_n, max_logprobs=engine.max_logprobs)}
    digest = key_digest(api_key) if api_key else None
    options = {config.model_name: serving_options(config)}
    adapters = {adapter.lora_name: (config.model_name, adapter) for adapter in config.lora_requests()}
    return ingress.bind(
        servers, hub, limits, digest, config.max_request_body_bytes, options, config.metrics_require_api_key,
        adapters, config.lora_dirs, local_engine,
    )


def _ingress_deployment(config: ServerConfig, engine_resources: dict[str, Any] | None = None) -> Any:
    """The OpenAIIngress deployment. Without the engine it reserves no CPU and starts its
    successor before it stops on a redeploy; holding the engine (`engine_resources`), it is one
    replica with the engine's reservation, health check and grace period."""
    from ray import serve

    from pagedserve.cluster.ingress import OpenAIIngress
    from pagedserve.cluster.serve_engine_client import ingress_env_vars

    if engine_resources is None:
        options: dict[str, Any] = dict(
            ray_actor_options={"num_cpus": 0},
            graceful_shutdown_timeout_s=max(INGRESS_GRACEFUL_SHUTDOWN_S, config.graceful_shutdown_s),
            max_surge_percent=INGRESS_MAX_SURGE_PERCENT,
        )
    else:  # no engine replica's handover to wait for: its streams get the engine's grace period
        options = dict(engine_resources, graceful_shutdown_timeout_s=config.graceful_shutdown_s, num_replicas=1, health_check_period_s=5)
    options["ray_actor_options"] = {**options["ray_actor_options"], "runtime_env": {"env_vars": ingress_env_vars()}}
    return serve.deployment(
        OpenAIIngress, name=INGRESS_DEPLOYMENT, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
        graceful_shutdown_wait_loop_s=INGRESS_SHUTDOWN_POLL_S, **options,
    )


def _server_deployment(config: ServerConfig, worker_bundles: list[dict[str, float]]) -> Any:
    """The LLMServer deployment (`engine_host` 'replicas'), scaled, routed and reserved."""
    from ray import serve

    from pagedserve.cluster.llm_server import LLMServer

    options = config.deployment
    return serve.deployment(LLMServer, name=SERVER_DEPLOYMENT).options(
        max_ongoing_requests=options.max_ongoing_requests,
        max_queued_requests=options.max_queued_requests,
        graceful_shutdown_timeout_s=config.graceful_shutdown_s,
        health_check_period_s=5,
        request_router_config=request_router_config(config),
        **options.serve_scaling_options(),
        **_engine_resources(config, worker_bundles),
    )


def _engine_resources(config: ServerConfig, worker_bundles: list[dict[str, float]]) -> dict[str, Any]:
    """Serve options that reserve what the deployment hosting the engine needs: its CPUs, and a
    placement group (that process first, then one bundle per rank in order) where ranks run apart."""
    num_cpus = config.deployment.num_cpus
    resources: dict[str, Any] = {"ray_actor_options": {"num_cpus": num_cpus}}
    if worker_bundles:  # the one place the layout is decided: the engine's host, then its ranks in order
        resources.update(placement_group_bundles=[{"CPU": num_cpus}, *worker_bundles], placement_group_strategy="PACK")
    return resources


def serving_options(config: ServerConfig) -> Any:
    """The OpenAI front end's settings from the server's config."""
    from pagedserve.cluster.serving_options import ServingOptions

    names = ("enable_auto_tool_choice", "tool_call_parser", "reasoning_parser", "generation_config", "engine_transport")
    return ServingOptions(**{name: getattr(config, name) for name in names})


def request_router_config(config: ServerConfig) -> dict[str, Any]:
    """Serve's `request_router_config` for the LLMServer deployment: the prefix-aware router
    with the engine's block size (so its hashes are the prefix cache's), or Serve's default
    power of two choices. Replicas report routing stats every `routing_stats_period_s` either
    way (they are cheap, and a router switched later finds them)."""
    options = config.deployment
    engine = config.engine_config()
    router = options.resolved_request_router(engine.enable_prefix_caching)
    period = {"request_routing_stats_period_s": options.routing_stats_period_s}
    if router == "power_of_two":  # Serve's default choice, with the handover (cluster/handover_router.py)
        return {**period, "request_router_class": "pagedserve.cluster.handover_router:PowerOfTwoRouter"}
    if not engine.enable_prefix_caching:
        raise ValueError(
            "deployment.request_router=prefix_aware needs engine.enable_prefix_caching=true; "
            "set request_router: power_of_two to route without a prefix cache"
        )
    kwargs = {
        "block_size": engine.block_size,
        "imbalanced_threshold": options.imbalanced_threshold,
        "match_rate_threshold": options.match_rate_threshold,
    }
    return {**period, "request_router_class": "pagedserve.cluster.prefix_router:PrefixAwareRouter", "request_router_kwargs": kwargs}


def serve_application_config(config: ServerConfig, name: str, route_prefix: str = "/") -> dict[str, Any]:
    """This server as an entry of a Serve config's `applications:` (what `serve deploy` and
    KubeRay's serveConfigV2 take). The replica count goes in Serve's `deployments:` override,
    not in `args`: Serve restarts every replica of an app whose args change (they are part of
    its code version), while a changed override only starts or stops the replicas added or
    removed. Edit the override to scale. The engine runs in LLMServer replicas here, which is
    what the override scales: `engine_host` 'ingress' is refused."""
    if config.engine_host == "ingress":
        raise ValueError("engine_host 'ingress' has no LLMServer deployment for a Serve config's deployments: override to scale; use 'auto' or 'replicas'")
    args = config.model_dump(mode="json", exclude_unset=True)
    deployment = {key: value for key, value in args.get("deployment", {}).items() if key not in SCALE_FIELDS}
    args = {**args, "deployment": deployment} if deployment else {k: v for k, v in args.items() if k != "deployment"}
    override = {"name": SERVER_DEPLOYMENT, **config.deployment.serve_scaling_options()}
    return {"name": name, "route_prefix": route_prefix, "import_path": IMPORT_PATH, "args": args, "deployments": [override]}


def place_workers(config: ServerConfig) -> tuple[ServerConfig, list[dict[str, float]]]:
    """Decide where the engine's ranks run, and check the cluster can hold them (before any
    actor starts). Returns the config with the executor backend set, and the worker bundles."""
    from pagedserve.ray_env import cluster_resources

    engine = config.engine_config()
    resources = cluster_resources()
    use_gpu = engine.device == "cuda" or (engine.device == "auto" and resources.get("GPU", 0) > 0)
    if not use_gpu and engine.world_size == 1:
        return config, []  # one CPU rank: the replica runs it itself
    kind = "GPU" if use_gpu else "CPU"
    # Checked per replica: the replica count changes without a rebuild (Serve's `deployments:`
    # override, autoscaling), and replicas beyond what the cluster holds now wait for nodes
    # (Ray's autoscaler adds them) instead of failing the deploy.
    needed = engine.world_size + (config.deployment.num_cpus if kind == "CPU" else 0)
    available = resources.get(kind, 0)
    if available < needed:
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size = {engine.world_size} per replica needs {needed:g} {kind}s "
            f"but the Ray cluster has {available:g} (a cluster that autoscales must hold one replica when the app deploys)"
        )
    engine_args = {**config.engine, "distributed_executor_backend": "ray", "device": "cuda" if use_gpu else "cpu"}
    config = config.model_copy(update={"engine": engine_args})
    return config, [{kind: 1}] * engine.world_size
