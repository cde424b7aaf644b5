"""The engine's only way to the model: `execute_model(SchedulerOutput) -> ModelRunnerOutput`."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.step_types.scheduler_output import SchedulerOutput


class WorkerGroupError(RuntimeError):
    """A worker died or failed mid-step: the group's state is lost and it must be rebuilt."""


class StepTooLargeError(ValueError):
    """A step does not fit the channel to the workers. Nothing of it was sent: the workers are
    fine, and the engine runs the step in parts (engine/step_split.py) instead."""

    def __init__(self, size: int, max_bytes: int):
        super().__init__(f"a step of {size} bytes exceeds the step channel's {max_bytes}-byte limit")
        self.size, self.max_bytes = size, max_bytes


class Executor(ABC):
    """Owns the workers. Subclasses decide where they run (in-process, Ray actors)."""

    # Where the ranks run, for the error when 'cuda' is asked for and none is there.
    ranks_run_where = "in this process"

    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig):
        self.engine_config = engine_config
        self.model_config = model_config

    @classmethod
    def resolve_device(cls, engine_config: EngineConfig) -> str:
        """`engine_config.device` ('auto', 'cpu' or 'cuda') made concrete: where this kind of
        executor would run the ranks. The executor decides because only it knows where they run."""
        has_gpu = cls.ranks_have_gpu(engine_config)
        if engine_config.device == "auto":
            return "cuda" if has_gpu else "cpu"
        if engine_config.device == "cuda" and not has_gpu:
            raise ValueError(f"device='cuda' was asked for but no CUDA device is available {cls.ranks_run_where}")
        return engine_config.device

    @classmethod
    def ranks_have_gpu(cls, engine_config: EngineConfig) -> bool:
        """Whether the ranks' machines have a GPU: by default, whether this process sees one."""
        return torch.cuda.is_available()

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """The KV block count every rank can hold (the minimum over ranks)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; raises WorkerGroupError if a worker died or failed, and
        StepTooLargeError (having sent nothing) if the step does not fit its channel."""

    def shutdown(self) -> None:
        """Release the workers; safe to call more than once."""
