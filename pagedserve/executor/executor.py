"""The engine's only way to the model: `execute_model(SchedulerOutput) -> ModelRunnerOutput`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from pagedserve.config import EngineConfig, ModelConfig, WorkerPlacement
from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.step_types.scheduler_output import SchedulerOutput


def resolve_device(device: str, has_gpu: bool | None = None, where: str = "in this process") -> str:
    """`device` ('auto', 'cpu' or 'cuda') made concrete. `has_gpu`: whether the ranks' machines
    have a GPU (the Ray executor asks its cluster); by default whether this process sees one."""
    if has_gpu is None:
        has_gpu = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if has_gpu else "cpu"
    if device == "cuda" and not has_gpu:
        raise ValueError(f"device='cuda' was asked for but no CUDA device is available {where}")
    return device


class WorkerGroupError(RuntimeError):
    """A worker died or failed mid-step: the group's state is lost and it must be rebuilt."""


class Executor(ABC):
    """Owns the workers. Subclasses decide where they run (in-process, Ray actors)."""

    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig):
        self.engine_config = engine_config
        self.model_config = model_config

    @staticmethod
    def class_for(engine_config: EngineConfig) -> type[Executor]:
        """The executor the config asks for: in-process for one rank, Ray actors otherwise."""
        world_size = engine_config.world_size
        if engine_config.executor_backend == "uni":
            if world_size > 1:
                raise ValueError(
                    f"distributed_executor_backend='uni' runs one rank in-process; "
                    f"tensor_parallel_size x pipeline_parallel_size = {world_size} needs 'ray'"
                )
            from pagedserve.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor
        from pagedserve.executor.ray_executor import RayExecutor

        return RayExecutor

    @staticmethod
    def create(engine_config: EngineConfig, model_config: ModelConfig, placement: WorkerPlacement | None = None) -> Executor:
        """`placement`: the bundles of a Ray Serve replica's group that hold the ranks; by
        default the Ray executor makes and owns a group of its own."""
        executor_class = Executor.class_for(engine_config)
        if placement is None or engine_config.executor_backend == "uni":  # one rank: no bundles to use
            return executor_class(engine_config, model_config)
        return executor_class(engine_config, model_config, placement)

    @classmethod
    @abstractmethod
    def resolve_device(cls, engine_config: EngineConfig) -> str:  # see resolve_device() above
        """'cpu' or 'cuda': where this kind of executor would run the ranks. The executor decides
        because only it knows where they run (and the Ray one may have to start Ray to ask)."""

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """The KV block count every rank can hold (the minimum over ranks)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; raises WorkerGroupError if a worker died or failed."""

    def shutdown(self) -> None:
        """Release the workers; safe to call more than once."""
