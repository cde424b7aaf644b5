"""The decoder layers' native CPU path (workers/models/native_layers.py) computes what the module
tree computes, to the bit, for every architecture it takes (GQA, MQA with its own head_dim, QKV
bias with tied embeddings), in mixed prefill-and-decode and decode-only steps; and it steps aside
where a step needs the modules: per-head q/k norm (Qwen3), bfloat16, the profiling pass, a step
with adapters."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import native_build
from pagedserve.workers.layers import cpu_gemm
from pagedserve.workers.models import native_layers
from pagedserve.workers.models.native_layers import NativeLayers
from tests.workers.test_cpu_gemm import _forward

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cpu_forward import build  # noqa: E402  (the model as a CPU worker loads it)

MIXED = {"query_lens": (1, 1, 9, 5), "context_lens": (30, 12, 0, 7)}
DECODE = {"query_lens": (1, 1, 1), "context_lens": (30, 12, 7)}


@pytest.fixture(autouse=True)
def native_gemm(monkeypatch):
    """The path is the native GEMM's, which `auto` picks on CPUs without AVX-512: forced here so
    it runs on every x86 machine (all have AVX2); a failed build fails rather than skips."""
    assert native_build.load() and torch.ops.pagedserve_cpu.fp32_gemm_built(), "the native CPU kernels did not build"
    monkeypatch.setattr(cpu_gemm, "_fp32_gemm", ["native"])


def _runs(monkeypatch) -> list[int]:
    """Counts the steps the native path runs (one entry each)."""
    calls: list[int] = []
    forward = NativeLayers.forward

    def counted(self, *args):
        calls.append(1)
        return forward(self, *args)

    monkeypatch.setattr(NativeLayers, "forward", counted)
    return calls


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("step", [MIXED, DECODE], ids=["mixed", "decode"])
@torch.inference_mode()
def test_the_native_layers_are_the_modules_to_the_bit(name, step, model_dirs, monkeypatch):
    model = build(model_dirs[name], torch.float32, max_positions=128)
    runs = _runs(monkeypatch)
    native = _forward(model, **step)
    assert runs == [1] and isinstance(model.model._native_layers, NativeLayers)
    model.model._native_layers = False  # the module tree
    modules = _forward(model, **step)
    assert runs == [1]
    assert torch.equal(native, modules)


@torch.inference_mode()
def test_per_head_qk_norm_and_bfloat16_run_the_modules(model_dirs, monkeypatch):
    runs = _runs(monkeypatch)
    qwen3 = build(model_dirs["qwen3"], torch.float32, max_positions=128)
    _forward(qwen3)
    assert qwen3.model._native_layers is False
    # Widened onto the same float32 panels, but the layers between are bfloat16.
    monkeypatch.setattr(cpu_gemm, "packs_dtype", lambda dtype: dtype == torch.float32)
    monkeypatch.setattr(cpu_gemm, "small_batch_rows", lambda: 0)
    bf16 = build(model_dirs["llama"], torch.bfloat16, max_positions=128)
    _forward(bf16)
    assert bf16.model._native_layers is False and runs == []


@torch.inference_mode()
def test_a_step_with_adapters_and_the_profiling_pass_run_the_modules(model_dirs, monkeypatch):
    model = build(model_dirs["llama"], torch.float32, max_positions=128)
    runs = _runs(monkeypatch)
    model(torch.arange(6), torch.arange(6), None)  # the memory-profiling pass: no cache, no metadata
    assert runs == [] and model.model._native_layers is None  # not decided before a real step
    monkeypatch.setattr(native_layers, "current_groups", lambda: object())  # the step has adapters
    _forward(model)
    assert runs == [] and isinstance(model.model._native_layers, NativeLayers)
    monkeypatch.setattr(native_layers, "current_groups", lambda: None)
    _forward(model)
    assert runs == [1]
