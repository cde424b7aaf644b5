"""One rank: its device, its process-group membership, its model shard and its KV cache.

The in-process executor holds one `Worker`; the Ray executor wraps the same class in an actor.
"""

from __future__ import annotations

import torch

from pagedserve.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ModelConfig
from pagedserve.engine.outputs import ModelRunnerOutput, SchedulerOutput
from pagedserve.workers.model_runner import ModelRunner
from pagedserve.workers.parallel_state import ParallelContext


class Worker:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, parallel: ParallelContext | None = None):
        self.engine_config = engine_config
        self.model_config = model_config
        self.parallel = parallel or ParallelContext()
        self.device = torch.device(model_config.device)
        self.runner: ModelRunner | None = None
        self._memory_in_use_at_start = 0

    def init_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            self._memory_in_use_at_start = total - free  # other processes' and this context's
        self.runner = ModelRunner(self.engine_config, self.model_config, self.parallel, self.device)

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit on this rank: `num_gpu_blocks_override`, else
        `kv_cache_memory_bytes`, else (CUDA) what a profiling pass leaves of
        `gpu_memory_utilization`, else (CPU) a modest default."""
        config = self.engine_config
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        per_block = self.runner.kv_cache_bytes_per_block()
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_free_memory()
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        return budget // per_block

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.runner.execute_model(scheduler_output)

    def _profile_free_memory(self) -> int:
        torch.cuda.reset_peak_memory_stats()
        budget_tokens = self.engine_config.max_num_batched_tokens or self.model_config.max_num_batched_tokens_default
        self.runner.profile_run(budget_tokens)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()  # weights + activations of the largest step
        free, total = torch.cuda.mem_get_info()
        # Memory this process holds outside torch's allocator (CUDA context, NCCL buffers).
        outside_torch = max(total - free - torch.cuda.memory_reserved() - self._memory_in_use_at_start, 0)
        available = int(total * self.engine_config.gpu_memory_utilization) - self._memory_in_use_at_start - peak - outside_torch
        if available <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: the model and a {budget_tokens}-token step peak at "
                f"{peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB at gpu_memory_utilization="
                f"{self.engine_config.gpu_memory_utilization}; raise it or lower max_num_batched_tokens"
            )
        torch.cuda.empty_cache()
        return available
