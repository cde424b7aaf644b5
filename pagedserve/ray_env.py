"""Starting or joining Ray: the one place the project does it (the engine's executor, the Serve
launcher and the replica placement all use it). A bottom-layer module: it imports nothing from
the project, so every layer may use it."""

from __future__ import annotations

import os


def ensure_ray_initialized(min_cpus: int) -> bool:
    """Join the cluster at RAY_ADDRESS or an already initialised Ray; else start a local one with
    at least `min_cpus` CPU slots (logical: CPU ranks may share real cores). True if it started one."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        return False
    ray.init(num_cpus=max(os.cpu_count() or 1, min_cpus), include_dashboard=False, log_to_driver=False)
    return True


def cluster_resources(min_cpus: int = 1) -> dict[str, float]:
    """The Ray cluster's total resources, starting or joining it first (see ensure_ray_initialized)."""
    import ray

    ensure_ray_initialized(min_cpus)
    return ray.cluster_resources()
