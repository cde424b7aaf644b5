"""The core client `EngineConfig.engine_core_process` asks for (see client.py)."""

from __future__ import annotations

from pagedserve.config import EngineConfig, WorkerPlacement
from pagedserve.engine.core.client import EngineCoreClient


def make_client(config: EngineConfig, placement: WorkerPlacement | None = None) -> EngineCoreClient:
    """Starts the core and waits until it is built (its errors are raised here)."""
    if config.engine_core_process:
        from pagedserve.engine.core.mp_client import MPClient

        return MPClient(config, placement)
    from pagedserve.engine.core.inproc_client import InprocClient

    return InprocClient(config, placement)
