"""Which executor a config asks for, and making one. Apart from the base class, so that the base
imports neither implementation (they import it)."""

from __future__ import annotations

from pagedserve.config import EngineConfig, ModelConfig, WorkerPlacement
from pagedserve.executor.executor import Executor


def executor_class(engine_config: EngineConfig) -> type[Executor]:
    """The executor the config asks for: in-process for one rank, Ray actors otherwise."""
    world_size = engine_config.world_size
    if engine_config.executor_backend == "uni":
        if world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank in-process; "
                f"tensor_parallel_size x pipeline_parallel_size = {world_size} needs 'ray'"
            )
        from pagedserve.executor.uniproc_executor import UniProcExecutor  # imports torch's model code

        return UniProcExecutor
    from pagedserve.executor.ray_executor import RayExecutor

    return RayExecutor


def create_executor(engine_config: EngineConfig, model_config: ModelConfig, placement: WorkerPlacement | None = None) -> Executor:
    """`placement`: the bundles of a Ray Serve replica's group that hold the ranks; by default the
    Ray executor makes and owns a group of its own."""
    cls = executor_class(engine_config)
    if placement is None or engine_config.executor_backend == "uni":  # one rank: no bundles to use
        return cls(engine_config, model_config)
    return cls(engine_config, model_config, placement)
