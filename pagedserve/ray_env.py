"""Starting or joining Ray: the one place the project does it (the engine's executor, the Serve
launcher and the replica placement all use it). A bottom-layer module: it imports nothing from
the project, so every layer may use it."""

from __future__ import annotations

import os

# Ray's raylet starts every worker process (Serve's replicas, the engine core process they start,
# the engine's ranks) at this niceness above its own: 15 by default, meant to keep the raylet
# responsive beside batch jobs. For a server the workers are the work: in one scheduling group (a
# Kubernetes pod's cgroup, a systemd unit, one session's autogroup) a nice-0 process that wants the
# same core (the raylet, the GCS, a sidecar) gets about 28 times a nice-15 worker's share of it. A
# Ray that pagedserve starts runs its workers at its own niceness; a value the user exported wins.
# (Across groups nice orders nothing: a busy process in another session stalled the model's
# threads at nice 0 as at 15; binding them, `cpu_omp_threads_bind`, is what fixed that:
# docs/benchmarks.md, forty-fourth session.)
WORKER_NICENESS_VARIABLE = "RAY_worker_niceness"


def worker_niceness_config(environ: dict | None = None) -> dict[str, int]:
    """The `_system_config` that starts Ray's workers at the raylet's own niceness, unless the
    environment sets Ray's variable (which Ray reads itself, and a system config would override)."""
    environ = os.environ if environ is None else environ
    return {} if WORKER_NICENESS_VARIABLE in environ else {"worker_niceness": 0}


def ensure_ray_initialized(min_cpus: int) -> bool:
    """Join the cluster at RAY_ADDRESS or an already initialised Ray; else start a local one with
    at least `min_cpus` CPU slots (logical: CPU ranks may share real cores). True if it started one."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return False
    ray.init(
        num_cpus=max(os.cpu_count() or 1, min_cpus),
        include_dashboard=False,
        log_to_driver=False,
        _system_config=worker_niceness_config(),
    )
    return True


def cluster_resources(min_cpus: int = 1) -> dict[str, float]:
    """The Ray cluster's total resources, starting or joining it first (see ensure_ray_initialized)."""
    import ray

    ensure_ray_initialized(min_cpus)
    return ray.cluster_resources()
