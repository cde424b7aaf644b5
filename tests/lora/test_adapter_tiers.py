"""The GPU layout of adapters, run on the CPU: `max_loras` adapters attached to the layers (a
GPU's device slots), up to `max_cpu_loras` kept in host memory. The layout is what a CUDA
device gets by default (`tiered`); here it is asked for, so that the bookkeeping runs in every
suite. An adapter evicted from its slot comes back from host memory without reading its folder
again, at most `max_loras` are ever attached, and every answer stays PEFT's."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from pagedserve import LLM
from pagedserve.workers import model_runner
from pagedserve.workers.lora import manager as lora_manager
from tests.e2e.test_hf_exactness import PROMPTS
from tests.lora.conftest import ADAPTERS
from tests.lora.test_lora_exactness import run_and_check


class RecordingManager(lora_manager.WorkerLoRAManager):
    """The tiered manager, recording what it attaches and how many adapters its layers carry."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, tiered=True)
        self.installs: list[str] = []
        self.most_attached = 0
        self.most_in_host = 0

    def _install(self, request, prepared):
        super()._install(request, prepared)
        self.installs.append(request.lora_name)

    def ensure(self, requests, in_use):
        super().ensure(requests, in_use)
        on_layers = {lora_id for module in self._modules() for lora_id in module.lora_weights}
        assert on_layers == set(self.resident), "the layers carry exactly the attached adapters"
        self.most_attached = max(self.most_attached, len(self.resident))
        self.most_in_host = max(self.most_in_host, len(self.host))


@pytest.fixture
def tiered_engine(monkeypatch, model_dirs):
    """An LLM whose rank keeps the GPU layout, and the count of each adapter folder's reads."""
    reads: Counter = Counter()
    real_read = lora_manager.read_adapter

    def counting_read(spec):
        reads[spec.path.name] += 1
        return real_read(spec)

    monkeypatch.setattr(lora_manager, "read_adapter", counting_read)
    monkeypatch.setattr(model_runner, "WorkerLoRAManager", RecordingManager)
    llms = []

    def start(**settings) -> tuple[LLM, RecordingManager]:
        llm = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=8, **settings)
        llms.append(llm)
        return llm, llm.llm_engine.engine_core.engine_core.executor.worker.runner.lora_manager

    yield start, reads
    for llm in llms:
        llm.shutdown()


def test_an_evicted_adapter_returns_from_host_memory(tiered_engine, lora_adapters, lora_references):
    start, reads = tiered_engine
    llm, manager = start(max_loras=1, max_cpu_loras=len(ADAPTERS))
    assert (manager.slots, manager.host_capacity) == (1, len(ADAPTERS))
    for _ in range(2):  # the second round needs the adapters the first evicted
        run_and_check(llm, "llama", lora_adapters["llama"], lora_references, PROMPTS[:2])
    assert manager.most_attached == 1
    assert len(manager.installs) > len(ADAPTERS), f"no adapter came back to a slot: {manager.installs}"
    assert reads == Counter({name: 1 for name in ADAPTERS}), "host memory held every adapter: each folder read once"


def test_host_memory_holds_max_cpu_loras_and_reads_the_rest_again(tiered_engine, lora_adapters, lora_references):
    start, reads = tiered_engine
    llm, manager = start(max_loras=1, max_cpu_loras=2)
    for _ in range(2):
        run_and_check(llm, "llama", lora_adapters["llama"], lora_references, PROMPTS[:2])
    assert (manager.most_attached, manager.most_in_host) == (1, 2)
    assert sum(reads.values()) > len(ADAPTERS), f"three adapters in two host places, yet no folder was read twice: {reads}"


def test_a_removed_adapter_leaves_its_slot_and_host_memory(tiered_engine, lora_adapters, lora_references):
    start, _ = tiered_engine
    llm, manager = start(max_loras=2, max_cpu_loras=3)
    run_and_check(llm, "llama", lora_adapters["llama"], lora_references, PROMPTS[:1])
    held = set(manager.host)
    assert held == {1, 2, 3} and len(manager.resident) == 2
    assert manager.remove(1) and manager.remove(3)
    assert 1 not in manager.host and 3 not in manager.host and 1 not in manager.resident
    assert not manager.remove(1)


def test_the_cpu_keeps_every_adapter_attached_by_default(monkeypatch, model_dirs):
    """On the CPU the layers read host memory: no second copy, every held adapter attached."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=128, enable_lora=True, max_loras=1, max_cpu_loras=3,
              device="cpu")
    try:
        manager = llm.llm_engine.engine_core.engine_core.executor.worker.runner.lora_manager
        assert not manager.tiered and (manager.slots, manager.host_capacity) == (3, 0)
    finally:
        llm.shutdown()


def test_a_gpu_gets_the_tiered_layout():
    """Built without touching the device: the layout is chosen from the device's type."""
    no_layers = SimpleNamespace(model=SimpleNamespace(layers={}))
    manager = lora_manager.WorkerLoRAManager(no_layers, 8, 2, 6, torch.bfloat16, torch.device("cuda"))
    assert manager.tiered and (manager.slots, manager.host_capacity) == (2, 6)
    assert manager.read_device == torch.device("cpu") and manager.lora_dtype == torch.bfloat16
    without_host_bound = lora_manager.WorkerLoRAManager(no_layers, 8, 2, None, torch.bfloat16, torch.device("cuda"))
    assert (without_host_bound.slots, without_host_bound.host_capacity) == (2, 2)
