"""One rank, in the engine's own process."""

from __future__ import annotations

from pagedserve.config import EngineConfig, ModelConfig
from pagedserve.executor.executor import Executor
from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.step_types.scheduler_output import SchedulerOutput
from pagedserve.workers.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig):
        super().__init__(engine_config, model_config)
        self.worker: Worker | None = Worker(engine_config, model_config)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker = None  # drops the model and the KV cache
