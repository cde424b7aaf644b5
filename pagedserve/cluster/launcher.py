"""`pagedserve serve`: run the OpenAI-compatible Serve app until SIGINT or SIGTERM.

It joins the Ray cluster at RAY_ADDRESS or starts a local one, checks the cluster can hold the
engine's ranks before any actor starts (on a local cluster it started itself, a lone CPU engine
replica gets every core: `machine_defaults`), prints the URL and a curl example, and on a signal stops
taking requests, lets in-flight ones finish for `graceful_shutdown_s` (Serve then aborts them),
releases every actor and exits. Ray processes it starts run on tcmalloc where the machine has it
(cluster/tcmalloc.py), and Serve's control loop there runs once a second (`slow_serve_control_loop`).
On such a cluster the ingress replica answers HTTP on the port itself (`http_ingress`, Serve's
direct ingress): no hop through Serve's proxy for a request or its tokens; and, for one fixed
replica, it holds the engine itself (`engine_host`): no hop to an LLMServer replica either.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable

from pagedserve.cluster import tcmalloc
from pagedserve.cluster.server_config import SERVE_DIRECT_INGRESS_VARIABLE, ServerConfig

APP_NAME = "pagedserve"

# The KV cache of a lone CPU replica on a machine it has to itself: an eighth of the memory, at
# most 4 GiB (vLLM's CPU default before it sized the cache itself). The engine's own default,
# 256 MiB (tests, offline runs beside other work), holds 11.6k tokens of SmolLM2: at saturation,
# 200 prompts of 128 + 64 tokens ran about 60 at a time and waited for the rest (TTFT p50 28.5 s
# against vLLM's 18.5 s with 4 GiB, Zen 4; docs/benchmarks.md).
SERVER_CPU_KV_CACHE_MAX_BYTES = 4 * 1024**3
SERVER_CPU_KV_CACHE_MEMORY_FRACTION = 1 / 8

# Serve's controller runs its control loop every 0.1 s by default, and on a machine the engine
# shares each wake-up takes a core from one of the model's threads. Once a second, TTFT p50 with
# one request in flight fell from 73-78 to 69-71 ms (2-core Zen 5; docs/benchmarks.md); deploys,
# scaling and health checks react up to a second later. Set for a Ray cluster this command starts;
# a value already in the environment wins.
SERVE_CONTROL_LOOP_VARIABLE = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
SERVE_CONTROL_LOOP_INTERVAL_S = 1.0


def serve_forever(config: ServerConfig) -> int:
    import ray
    from ray import serve

    from pagedserve.cluster.app import INGRESS_DEPLOYMENT, build_app
    from pagedserve.ray_env import ensure_ray_initialized

    config.resolve_api_key()  # a key file that is missing or empty stops us before Ray starts
    starts_ray = not ray.is_initialized() and not os.environ.get("RAY_ADDRESS")
    direct = uses_direct_ingress(config, starts_ray)
    config = config.model_copy(update={"engine_host": resolved_engine_host(config, starts_ray)})
    if starts_ray:
        allocator = tcmalloc.preload_for_children()
        print(f"pagedserve: {f'tcmalloc preloaded ({allocator})' if allocator else 'no tcmalloc found: glibc malloc'}", flush=True)
        slow_serve_control_loop()
    if direct:
        check_port_is_free(config.host, config.port)  # else the ingress replica would retry it and fail, less clearly
        direct_ingress_environment(config.port)
    # Each replica takes a CPU slot, and so does each rank of a CPU engine.
    replicas = config.deployment.max_num_replicas
    started_ray = ensure_ray_initialized(replicas * (1 + config.engine_config().world_size))
    if started_ray:
        config = machine_defaults(config, ray.cluster_resources())
    try:
        # After ray.init (which installs its own SIGTERM handler) and before the app can answer: a
        # signal that arrives while Serve is still starting must also drain and stop cleanly.
        stop_signal = _catch_stop_signals()
        app = build_app(config)  # validates the placement before any actor starts
        # With direct ingress Serve still runs its proxy on the head node; it gets a port of its own.
        serve.start(http_options={"host": config.host, "port": free_port(config.host) if direct else config.port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        _print_banner(config)
        if direct:
            print(f"pagedserve: the ingress replica answers on port {config.port} itself (http_ingress: direct)", flush=True)
        if config.engine_host == "ingress":
            print("pagedserve: the engine runs in the ingress replica's process (engine_host: ingress)", flush=True)
        stop = stop_signal()
        print(f"pagedserve: {signal.Signals(stop).name} received: draining (up to {config.graceful_shutdown_s:g} s)", flush=True)
        if direct:  # no proxy turns new requests away while the app is deleted: the ingress must
            _stop_taking_requests(serve.get_deployment_handle(INGRESS_DEPLOYMENT, APP_NAME))
        serve.delete(APP_NAME)  # blocks until the app is gone (its default)
        serve.shutdown()
    finally:
        if started_ray:
            ray.shutdown()
    print("pagedserve: stopped", flush=True)
    return 0


def uses_direct_ingress(config: ServerConfig, starts_ray: bool) -> bool:
    """Whether the ingress replica answers HTTP itself (`http_ingress`). Serve reads its direct
    ingress settings from the environment once, in every process of the cluster, so only a
    cluster this command starts can have them; 'direct' on another is an error."""
    if config.http_ingress == "direct" and not starts_ray:
        raise ValueError(
            "http_ingress 'direct' needs a Ray cluster `pagedserve serve` starts itself (Serve reads it from every Ray "
            "process's environment at start), but RAY_ADDRESS names one already running: use 'proxy' or 'auto'"
        )
    return starts_ray and config.http_ingress != "proxy"


def resolved_engine_host(config: ServerConfig, starts_ray: bool) -> str:
    """`engine_host`, with 'auto' decided: the engine in the ingress's process where this command
    starts Ray and one fixed replica is asked for (nothing else can scale it), else LLMServer
    replicas. With the engine in the ingress (2-core Zen 5, bf16 SmolLM2, 128 tokens in, 64 out):
    one request in flight, TTFT p50 51 against 58-61 ms; 256 in flight, 1.02-1.04x the output
    tokens and TTFT p50 4.6 against 5.1-5.2 s (local_engine.py, docs/benchmarks.md)."""
    if config.engine_host != "auto":
        return config.engine_host
    return "ingress" if starts_ray and config.deployment.is_one_fixed_replica else "replicas"


def direct_ingress_environment(port: int, environ: dict | None = None) -> None:
    """Serve's direct ingress in `environ` (default: this process's, which the Ray it starts
    inherits): the ingress replica serves HTTP on `port`, the only one in its range, and stops
    without Serve's 30 s wait for a load balancer to forget it (none is in front). One request in
    flight, TTFT p50 71 against 77-80 ms through the proxy; eight in flight, 371-404 against
    441-454 ms, 1.06-1.17x the output tokens (2-core Zen 5, one server, both ports alternately;
    docs/benchmarks.md)."""
    environ = os.environ if environ is None else environ
    environ.update({
        SERVE_DIRECT_INGRESS_VARIABLE: "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # exclusive
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    })


def check_port_is_free(host: str, port: int) -> None:
    """A ValueError naming `port` unless Serve could bind it now (`_bound`): a port in use, or
    held by the connections a server just closed (TIME_WAIT), is refused."""
    try:
        _bound(host, port).close()
    except OSError as error:
        raise ValueError(
            f"cannot serve on {host}:{port}: {error.strerror or error}; choose another --port (or wait: the connections of "
            "a server that just stopped hold its port for up to a minute)"
        ) from None


def free_port(host: str) -> int:
    """A port on `host` that Serve could bind now."""
    with _bound(host, 0) as probe:
        return probe.getsockname()[1]


def _bound(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) as Serve binds its HTTP servers: without SO_REUSEADDR."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def slow_serve_control_loop(environ: dict | None = None) -> None:
    """Serve's control loop at SERVE_CONTROL_LOOP_INTERVAL_S in `environ` (default: this process's,
    which the Ray it starts, and so Serve's controller, inherits), unless it is set already."""
    environ = os.environ if environ is None else environ
    environ.setdefault(SERVE_CONTROL_LOOP_VARIABLE, str(SERVE_CONTROL_LOOP_INTERVAL_S))


def machine_defaults(config: ServerConfig, resources: dict[str, float]) -> ServerConfig:
    """On a local Ray cluster this command started, nothing else runs: a single CPU engine
    replica whose `deployment.num_cpus` was not set gets every core Ray counts (Ray then gives the
    engine as many torch threads). Measured on a 2-core Zen 4 with Serve's proxy and the ingress
    beside it, these defaults against none of them (one thread, in process) serve 1.4-1.5x the
    output tokens at saturation, with ITL p50 at 1 req/s 19 against 30.6 ms
    (benchmarks/results/server_defaults/). Several replicas, a tensor- or pipeline-parallel engine, a
    GPU, or an explicit `num_cpus` keep the one-CPU reservation: replicas must not fight over cores.
    Its KV cache gets an eighth of the machine's memory, at most 4 GiB (`server_cpu_kv_cache_bytes`).
    With the engine in an LLMServer replica (`engine_host` 'replicas'), light steps (decode only,
    or a few tokens) leave one core to the processes between it and the client, whose work grows
    with the tokens streamed (`light_step_cpu_threads`): there a second model thread gained less
    than the stalls it suffered cost (model_runner.StepThreads). With the engine in the ingress
    ('ingress', what 'auto' becomes here) one such process is gone, and every step takes every
    core: 1.14-1.18x the output tokens at 256 in flight, 1.14x at 32, 1.10x at 8 (2-core Zen 5;
    docs/benchmarks.md).
    The engine core runs in its own process (`engine_core_process`), so the model's Python does not
    wait on the GIL behind Serve's event loop: at 1 req/s, ITL p50 19 ms against 23.7 in one
    process (the same files); with the model stepped on the thread that built it, 14.8-15.0
    against 15.6-16.2 ms, and 1.07x the output tokens at saturation (engine in the ingress,
    benchmarks/results/engine_core_process_zen4/)."""
    deployment, engine = config.deployment, config.engine_config()
    is_gpu = engine.device == "cuda" or (engine.device == "auto" and resources.get("GPU", 0) > 0)
    if "num_cpus" in deployment.model_fields_set or is_gpu or engine.world_size > 1 or deployment.max_num_replicas > 1:
        return config
    cores = float(resources.get("CPU", os.cpu_count() or 1))
    update: dict = {"deployment": deployment.model_copy(update={"num_cpus": cores})}
    engine_defaults = {"engine_core_process": True, "kv_cache_memory_bytes": server_cpu_kv_cache_bytes()}
    if cores >= 2 and config.engine_host == "replicas":
        engine_defaults["light_step_cpu_threads"] = int(cores) - 1
    update["engine"] = {**engine_defaults, **config.engine}  # what the user said wins
    return config.model_copy(update=update)


def server_cpu_kv_cache_bytes(total_bytes: int | None = None) -> int:
    """SERVER_CPU_KV_CACHE_MEMORY_FRACTION of the machine's memory (`total_bytes`, default: this
    machine's), at most SERVER_CPU_KV_CACHE_MAX_BYTES."""
    if total_bytes is None:
        total_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(min(SERVER_CPU_KV_CACHE_MAX_BYTES, total_bytes * SERVER_CPU_KV_CACHE_MEMORY_FRACTION))


def _stop_taking_requests(ingress: Any) -> None:
    """Tell the ingress replica to refuse new requests; if it cannot answer, stop anyway."""
    try:
        ingress.stop_taking_requests.remote().result(timeout_s=10)
    except Exception as error:  # a dead or wedged ingress must not keep the server from stopping
        print(f"pagedserve: the ingress did not confirm it stopped taking requests ({error!r}); stopping anyway", flush=True)


def _catch_stop_signals() -> Callable[[], int]:
    """Route SIGINT and SIGTERM to an event; returns a function that waits for the first one."""
    received: list[int] = []
    wake = threading.Event()

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        wake.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)

    def wait() -> int:
        while not wake.wait(1.0):  # a timeout keeps the main thread responsive to signals
            pass
        return received[0]

    return wait


def _print_banner(config: ServerConfig) -> None:
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    url = f"http://{host}:{config.port}"
    auth = ' -H "Authorization: Bearer $PAGEDSERVE_API_KEY"' if config.resolve_api_key() else ""
    body = '{"model": "%s", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32}' % config.model_name
    print(
        f"pagedserve: serving '{config.model_name}' at {url}/v1 (started {time.strftime('%H:%M:%S')})\n"
        f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'\n"
        "  stop with Ctrl-C or SIGTERM",
        flush=True,
        file=sys.stdout,
    )
