"""KV-cache sizing from GPU memory, and the default dtype on CUDA and on the CPU.

The sizing arithmetic runs on the CPU against a simulated GPU (torch.cuda's memory queries
replaced); the `gpu` tests check it against a real device."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from pagedserve import LLM
from pagedserve.config import EngineConfig
from pagedserve.model_resolver import _resolve_dtype, resolve_model_config
from pagedserve.executor.uniproc_executor import UniProcExecutor
from pagedserve.workers.worker import Worker

GiB = 2**30


class FakeGPU:
    """torch.cuda's memory queries for a GPU of `total` bytes: other processes hold `others`,
    this process's CUDA context `context`, and an engine started earlier in this process `held`
    (allocated and reserved through torch); a profile run allocates `peak` and `outside_torch`."""

    def __init__(self, monkeypatch, total, others, context, peak, outside_torch, held=0):
        self.total, self.used, self.held = total, others + context + held, held
        self.peak, self.outside_torch, self.reserved = peak, outside_torch, 0
        for name in ("reset_peak_memory_stats", "synchronize", "empty_cache"):
            monkeypatch.setattr(torch.cuda, name, lambda *args: None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *args: (self.total - self.used, self.total))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args: self.held + self.peak)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *args: self.held + self.reserved)

    def profile_run(self, num_tokens):
        self.reserved = self.peak + GiB // 2  # the caching allocator keeps more than the peak
        self.used += self.reserved + self.outside_torch


def sized_worker(monkeypatch, utilization, **gpu) -> Worker:
    config = EngineConfig(model="unused", gpu_memory_utilization=utilization, max_num_batched_tokens=512)
    worker = Worker(config, SimpleNamespace(device="cpu", max_model_len=2048))
    fake = FakeGPU(monkeypatch, **gpu)
    worker._free_memory_at_start = fake.total - fake.used  # what init_device measures
    worker._torch_memory_at_start = (fake.held, fake.held)
    worker.runner = SimpleNamespace(profile_run=fake.profile_run)
    return worker


def test_kv_budget_is_the_share_less_weights_activations_and_non_torch_memory(monkeypatch):
    worker = sized_worker(monkeypatch, 0.9, total=80 * GiB, others=0, context=GiB // 2, peak=10 * GiB, outside_torch=GiB)
    assert worker._profile_free_memory() == int(80 * GiB * 0.9) - 10 * GiB - GiB


def test_other_processes_do_not_shrink_the_share(monkeypatch):
    """Two engines at 0.45 share a GPU: the second still gets its 0.45."""
    worker = sized_worker(monkeypatch, 0.45, total=80 * GiB, others=36 * GiB, context=GiB // 2, peak=4 * GiB, outside_torch=0)
    assert worker._profile_free_memory() == int(80 * GiB * 0.45) - 4 * GiB


def test_an_engine_beside_another_in_this_process_gets_its_share(monkeypatch):
    """torch's peak and reserved counters include what an earlier engine in this process holds
    (found on an H200: a second LLM in one process counted the first's KV cache as its own)."""
    worker = sized_worker(monkeypatch, 0.1, total=80 * GiB, others=0, context=GiB // 2, peak=2 * GiB,
                          outside_torch=GiB, held=30 * GiB)
    assert worker._profile_free_memory() == int(80 * GiB * 0.1) - 2 * GiB - GiB


def test_share_not_free_at_start_is_an_error(monkeypatch):
    worker = sized_worker(monkeypatch, 0.9, total=80 * GiB, others=30 * GiB, context=GiB // 2, peak=4 * GiB, outside_torch=0)
    with pytest.raises(RuntimeError, match="were free at start"):
        worker._profile_free_memory()


def test_model_larger_than_the_share_is_an_error(monkeypatch):
    worker = sized_worker(monkeypatch, 0.1, total=80 * GiB, others=0, context=GiB // 2, peak=9 * GiB, outside_torch=0)
    with pytest.raises(RuntimeError, match="no GPU memory left for the KV cache"):
        worker._profile_free_memory()


@pytest.mark.parametrize(
    "checkpoint, has_bf16, expected",
    [
        ("float32", True, torch.bfloat16),
        (None, True, torch.bfloat16),
        ("bfloat16", True, torch.bfloat16),
        ("float16", True, torch.float16),
        ("float32", False, torch.float16),  # before Ampere
        ("bfloat16", False, torch.float16),
    ],
)
def test_auto_dtype_on_cuda(monkeypatch, checkpoint, has_bf16, expected):
    monkeypatch.setattr("pagedserve.model_resolver._gpu_supports_bfloat16", lambda: has_bf16)
    assert _resolve_dtype("auto", SimpleNamespace(dtype=checkpoint), "cuda") is expected
    assert _resolve_dtype("float32", SimpleNamespace(dtype=checkpoint), "cuda") is torch.float32


@pytest.mark.parametrize(
    "checkpoint, has_bf16, expected",
    [
        ("bfloat16", True, torch.bfloat16),  # half-precision weights, native bf16: vLLM's choice
        ("float16", True, torch.bfloat16),
        ("float32", True, torch.float32),  # full-precision weights keep their precision
        (None, True, torch.float32),
        ("bfloat16", False, torch.float32),  # no bf16 instructions: torch would emulate it
        ("float16", False, torch.float32),
    ],
)
def test_auto_dtype_on_cpu(monkeypatch, checkpoint, has_bf16, expected):
    monkeypatch.setattr("pagedserve.model_resolver.cpu_has_native_bfloat16", lambda: has_bf16)
    assert _resolve_dtype("auto", SimpleNamespace(dtype=checkpoint), "cpu") is expected
    assert _resolve_dtype("float32", SimpleNamespace(dtype=checkpoint), "cpu") is torch.float32


# ---- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_default_dtype_is_bfloat16(model_dirs):
    """The tiny checkpoints are float32; on an Ampere or newer GPU they run in bfloat16."""
    model_config = resolve_model_config(EngineConfig(model=str(model_dirs["llama"])), UniProcExecutor.resolve_device)
    assert model_config.device == "cuda"
    major, _ = torch.cuda.get_device_capability()
    assert model_config.dtype is (torch.bfloat16 if major >= 8 else torch.float16)


def _engine_memory(model_dir, utilization: float) -> tuple[int, int]:
    """(KV-cache bytes, bytes the engine took from the GPU) for an engine at `utilization`."""
    gc.collect()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    llm = LLM(str(model_dir), gpu_memory_utilization=utilization, enforce_eager=True, max_model_len=256)
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.runner
        kv_bytes = llm.llm_engine.num_kv_blocks * runner.kv_cache_bytes_per_block()
        return kv_bytes, free_before - torch.cuda.mem_get_info()[0]
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_kv_cache_fills_the_requested_share(model_dirs):
    total = torch.cuda.mem_get_info()[1]
    small_kv, small_used = _engine_memory(model_dirs["llama"], 0.2)
    large_kv, large_used = _engine_memory(model_dirs["llama"], 0.4)
    # A tiny model: the share is nearly all cache, and 0.2 more of the GPU is 0.2 more cache.
    assert small_kv > 0.15 * total
    assert abs((large_kv - small_kv) - 0.2 * total) < 0.01 * total
    # The engine stays within its share (plus a little for the CUDA context and kernels).
    for used, share in ((small_used, 0.2), (large_used, 0.4)):
        assert used < share * total + 1 * GiB
