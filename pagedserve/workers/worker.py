"""One rank: its device, its process-group membership, its model shard and its KV cache.

The in-process executor holds one `Worker`; the Ray executor runs the same class as an actor
(named `Worker` in Ray's state API) and drives its steps over a socket (`serve_steps`).
"""

from __future__ import annotations

import os
import socket
import threading
import traceback

import torch

from pagedserve.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ModelConfig
from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.step_types.scheduler_output import SchedulerOutput
from pagedserve.workers import step_channel
from pagedserve.workers.model_runner import ModelRunner
from pagedserve.workers.parallel_state import ParallelContext, init_parallel_context


class Worker:
    def __init__(self, engine_config: EngineConfig, model_config: ModelConfig, rank: int = 0):
        self.engine_config = engine_config
        self.model_config = model_config
        self.rank = rank
        self.parallel = ParallelContext()
        self.device = torch.device(model_config.device)
        self.runner: ModelRunner | None = None
        self._free_memory_at_start = 0  # CUDA: bytes free once this process's context exists
        # CUDA: (allocated, reserved) bytes torch held then: other engines in this process
        self._torch_memory_at_start = (0, 0)
        # The thread that set the device up: it loads, profiles and steps the model (a second
        # thread's parallel ops would run on a second OpenMP team, ray_executor.MODEL_THREAD).
        self.model_thread: int | None = None

    # ---- placement helpers (called by the Ray executor before init_device) -------------------

    def get_node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def get_pid(self) -> int:
        return os.getpid()

    def find_free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    # ---- set-up ----------------------------------------------------------------------------

    def init_device(self, distributed_init_method: str | None = None) -> None:
        """Pick the device and, with more than one rank, join the process group
        (NCCL on CUDA, gloo on the CPU). A CPU rank in a Ray actor runs as many torch threads as
        its bundle has CPUs (Ray sets OMP_NUM_THREADS)."""
        self.model_thread = threading.get_ident()
        if self.engine_config.world_size > 1:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            self.parallel = init_parallel_context(self.rank, self.engine_config, distributed_init_method, backend)
        if self.device.type == "cuda":
            if self.device.index is None:  # "cuda": this process's GPU (a Ray worker sees only its own)
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            self._free_memory_at_start = torch.cuda.mem_get_info()[0]  # before any weight loads
            self._torch_memory_at_start = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())
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

    # ---- the step loop (Ray workers) -------------------------------------------------------------

    def serve_steps(self, host: str, port: int, secret: bytes) -> None:
        """Connect to the executor, prove we hold the group's `secret` (and check it does), then
        run steps until it closes the connection. Each step gets a `StepReply`. Runs on the
        thread that set the device up (`model_thread`)."""
        if threading.get_ident() != self.model_thread:
            raise RuntimeError("serve_steps must run on the thread that set the device up and loaded the model (ray_executor.MODEL_THREAD)")
        sock = step_channel.connect(host, port, timeout=step_channel.HANDSHAKE_TIMEOUT_S)
        try:
            channel = step_channel.authenticate_engine(sock, secret, self.rank)
            channel.settimeout(None)  # idle between steps for as long as the engine likes
            while True:
                try:
                    scheduler_output = step_channel.recv_message(channel)
                except step_channel.ChannelClosed:
                    return
                try:
                    reply = step_channel.StepReply(output=self.execute_model(scheduler_output))
                except Exception:
                    reply = step_channel.StepReply(error=f"rank {self.rank}: {traceback.format_exc()}")
                step_channel.send_message(channel, reply)
        finally:
            sock.close()

    def _profile_free_memory(self) -> int:
        """Bytes for the KV cache. As in vLLM, `gpu_memory_utilization` is this engine's share of
        the GPU's total memory, whatever other processes use (several engines can share a GPU at
        0.45 each); that share must be free at start. The cache gets the share less the weights,
        the activation peak of the largest step, and what this process holds outside torch's
        allocator (cuBLAS and NCCL workspaces, compiled kernels). torch's counters are per process,
        so what other engines in this process held at start is taken off them."""
        utilization = self.engine_config.gpu_memory_utilization
        total = torch.cuda.mem_get_info()[1]
        requested = int(total * utilization)
        if requested > self._free_memory_at_start:
            raise RuntimeError(
                f"gpu_memory_utilization={utilization} asks for {requested / 2**30:.2f} GiB of the GPU's "
                f"{total / 2**30:.2f} GiB, but only {self._free_memory_at_start / 2**30:.2f} GiB were free at "
                "start (other processes hold the rest); lower gpu_memory_utilization or free the GPU"
            )
        torch.cuda.reset_peak_memory_stats()
        budget_tokens = self.engine_config.token_budget(self.model_config.max_model_len)
        self.runner.profile_run(budget_tokens)
        torch.cuda.synchronize()
        held_allocated, held_reserved = self._torch_memory_at_start
        peak = torch.cuda.max_memory_allocated() - held_allocated  # weights + the largest step's activations
        free = torch.cuda.mem_get_info()[0]
        outside_torch = max(self._free_memory_at_start - free - (torch.cuda.memory_reserved() - held_reserved), 0)
        available = requested - peak - outside_torch
        if available <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: the model and a {budget_tokens}-token step peak at "
                f"{peak / 2**30:.2f} GiB of the {requested / 2**30:.2f} GiB that gpu_memory_utilization="
                f"{utilization} allows; raise it or lower max_num_batched_tokens"
            )
        torch.cuda.empty_cache()
        return available
