"""The Serve application: OpenAI ingress -> LLMServer (one AsyncLLM per replica), plus the
metrics hub (every replica's statistics for /metrics, one series per replica).

`build_app` is the Serve config's `import_path` (`pagedserve.cluster.app:build_app`): Serve calls
it with the config's `args`, which are `ServerConfig` fields (engine arguments under `engine:` or
flat). The LLMServer replicas get a placement group each, laid out here and only here: bundle 0
for the replica (`deployment.num_cpus`, default one CPU), then one bundle per TP x PP rank (a GPU each on a GPU cluster), whose
indices the replica hands down to its executor. A CPU-only, single-rank engine runs in the
replica itself.
"""

from __future__ import annotations

from typing import Any

from pagedserve.config import ServerConfig

# Streams hold an ingress slot for their whole life; Serve's default (5) would queue requests at
# the ingress long before the engine is busy. Admission control is the LLMServer's job.
INGRESS_MAX_ONGOING_REQUESTS = 10_000


def build_app(args: dict[str, Any] | ServerConfig | None = None) -> Any:
    from ray import serve

    from pagedserve.cluster.handover import router_config
    from pagedserve.cluster.ingress import OpenAIIngress, key_digest
    from pagedserve.cluster.llm_server import LLMServer
    from pagedserve.cluster.metrics_hub import MetricsHub
    from pagedserve.cluster.openai_serving import RequestLimits

    config = args if isinstance(args, ServerConfig) else ServerConfig.load(overrides=args or {})
    api_key = config.resolve_api_key()  # before anything starts: a missing key file stops us here
    # The key itself never goes into a deployment's arguments (which Serve records and shows).
    config = config.model_copy(update={"api_key": None, "api_key_file": None})
    config, worker_bundles = place_workers(config)
    options = config.deployment
    server_options: dict[str, Any] = dict(
        max_ongoing_requests=options.max_ongoing_requests,
        max_queued_requests=options.max_queued_requests,
        graceful_shutdown_timeout_s=config.graceful_shutdown_s,
        health_check_period_s=5,
        ray_actor_options={"num_cpus": options.num_cpus},
        request_router_config=router_config(),  # hands a leaving replica's streams over
    )
    if options.autoscaling_config is not None:
        server_options["autoscaling_config"] = options.autoscaling_config
    else:
        server_options["num_replicas"] = options.num_replicas
    worker_bundle_indices: tuple[int, ...] = ()
    if worker_bundles:
        # The one place the layout is decided: the replica, then its ranks in order.
        server_options["placement_group_bundles"] = [{"CPU": options.num_cpus}, *worker_bundles]
        server_options["placement_group_strategy"] = "PACK"
        worker_bundle_indices = tuple(range(1, 1 + len(worker_bundles)))

    hub = serve.deployment(
        MetricsHub, name="MetricsHub", num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0}
    ).bind()
    server = serve.deployment(LLMServer, name="LLMServer").options(**server_options).bind(config, hub, worker_bundle_indices)
    ingress = serve.deployment(
        OpenAIIngress, name="OpenAIIngress", max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0}
    )
    engine = config.engine_config()
    limits = {config.model_name: RequestLimits(max_n=engine.max_n, max_logprobs=engine.max_logprobs)}
    digest = key_digest(api_key) if api_key else None
    return ingress.bind({config.model_name: server}, hub, limits, digest, config.max_request_body_bytes)


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
    replicas = config.deployment.num_replicas
    if config.deployment.autoscaling_config is not None:
        replicas = int(config.deployment.autoscaling_config.get("min_replicas", 1))
    needed = engine.world_size * max(replicas, 1) + (config.deployment.num_cpus * max(replicas, 1) if kind == "CPU" else 0)
    available = resources.get(kind, 0)
    if available < needed:
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size = {engine.world_size} per replica x {max(replicas, 1)} "
            f"replica(s) needs {needed:g} {kind}s but the Ray cluster has {available:g}"
        )
    engine_args = {**config.engine, "distributed_executor_backend": "ray", "device": "cuda" if use_gpu else "cpu"}
    config = config.model_copy(update={"engine": engine_args})
    return config, [{kind: 1}] * engine.world_size
