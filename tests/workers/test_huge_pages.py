"""The CPU KV cache in 2 MiB pages (workers/huge_pages.py): aligned, advised before its first
write, and what every CPU engine now allocates."""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve import LLM
from pagedserve.workers.huge_pages import HUGE_PAGE_BYTES, zeros_in_huge_pages

THP_SWITCH = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (proc(5): `hg` is
    MADV_HUGEPAGE's advice)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def assert_in_advised_huge_pages(tensor: torch.Tensor) -> None:
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    if THP_SWITCH.exists():  # a kernel built with transparent huge pages takes the advice
        assert "hg" in vm_flags(tensor.data_ptr())


def test_a_large_tensor_starts_on_a_huge_page_and_reads_and_writes_as_any_other():
    tensor = zeros_in_huge_pages((2, 3, 700, 16, 64), torch.bfloat16)  # 8.2 MiB
    assert tensor.shape == (2, 3, 700, 16, 64) and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
    assert not tensor.any()
    assert_in_advised_huge_pages(tensor)
    tensor[1, 2, 699, 15, 63] = 3.0
    tensor[0, 0, 0, 0, 0] = 1.0
    assert tensor.sum().item() == 4.0 and tensor.flatten()[-1].item() == 3.0


def test_a_tensor_under_a_huge_page_is_an_ordinary_one():
    tensor = zeros_in_huge_pages((4, 1000), torch.float32)
    assert tensor.shape == (4, 1000) and not tensor.any()
    assert tensor.untyped_storage().nbytes() == 16_000  # no buffer around it


def test_the_cpu_engine_allocates_its_kv_cache_there(model_dirs):
    llm = LLM(str(model_dirs["llama"]), max_model_len=256, kv_cache_memory_bytes=64 << 20)
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.runner
        layers = runner.model.attention_layers()
        assert layers and all(layer.kv_cache.nbytes >= HUGE_PAGE_BYTES for layer in layers)
        for layer in layers:
            assert_in_advised_huge_pages(layer.kv_cache)
    finally:
        llm.shutdown()
