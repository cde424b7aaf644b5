"""The decoder layers' native CPU path (workers/models/native_layers.py) computes what the module
tree computes, to the bit, for every architecture it takes (GQA, MQA with its own head_dim, QKV
bias with tied embeddings), in mixed prefill-and-decode and decode-only steps, on each GEMM a
linear layer can be packed for (the native float32 GEMM, oneDNN in float32 and bfloat16 with the
small-batch kernel for a few rows, bfloat16 widened onto float32 panels); and it steps aside where
a step needs the modules: per-head q/k norm (Qwen3), unpacked layers, the profiling pass, a step
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
from cpu_forward import build, steps  # noqa: E402  (the model as a CPU worker loads it)

MIXED = {"query_lens": (1, 1, 9, 5), "context_lens": (30, 12, 0, 7)}
DECODE = {"query_lens": (1, 1, 1), "context_lens": (30, 12, 7)}


needs_onednn_bf16 = pytest.mark.skipif(
    not cpu_gemm.packs_dtype(torch.bfloat16), reason="no AVX-512 here: oneDNN packs no bfloat16 GEMM (the widened case runs instead)"
)
# (the model's dtype, the float32 GEMM, whether oneDNN packs bfloat16): each way `cpu_gemm.pack`
# can pack a layer. "bf16-onednn" keeps the plain weights for the small-batch kernel where it is
# built (AVX-512 BF16), so its decode steps of 1-4 rows take that kernel.
GEMMS = {
    "fp32-native": (torch.float32, "native", None),
    "fp32-onednn": (torch.float32, "onednn", None),
    "bf16-widened": (torch.bfloat16, "native", False),
    "bf16-onednn": pytest.param((torch.bfloat16, "onednn", None), marks=needs_onednn_bf16),
}


@pytest.fixture(autouse=True)
def native_gemm(monkeypatch):
    """The native GEMM unless a test asks otherwise (`auto` picks it on CPUs without AVX-512):
    forced here so it runs on every x86 machine (all have AVX2); a failed build fails rather
    than skips."""
    assert native_build.load() and torch.ops.pagedserve_cpu.fp32_gemm_built(), "the native CPU kernels did not build"
    monkeypatch.setattr(cpu_gemm, "_fp32_gemm", ["native"])


def _packing(monkeypatch, fp32_gemm: str, onednn_bf16: bool | None) -> None:
    monkeypatch.setattr(cpu_gemm, "_fp32_gemm", [fp32_gemm])
    if onednn_bf16 is False:  # widened onto float32 panels, as on a CPU without AVX-512
        monkeypatch.setattr(cpu_gemm, "packs_dtype", lambda dtype: dtype == torch.float32)
        monkeypatch.setattr(cpu_gemm, "small_batch_rows", lambda: 0)


def _runs(monkeypatch) -> list[int]:
    """Counts the steps the native path runs (one entry each)."""
    calls: list[int] = []
    forward = NativeLayers.forward

    def counted(self, *args):
        calls.append(1)
        return forward(self, *args)

    monkeypatch.setattr(NativeLayers, "forward", counted)
    return calls


@pytest.mark.parametrize("gemm", GEMMS.values(), ids=GEMMS.keys())
@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("step", [MIXED, DECODE], ids=["mixed", "decode"])
@torch.inference_mode()
def test_the_native_layers_are_the_modules_to_the_bit(gemm, name, step, model_dirs, monkeypatch):
    dtype, fp32_gemm, onednn_bf16 = gemm
    _packing(monkeypatch, fp32_gemm, onednn_bf16)
    model = build(model_dirs[name], dtype, max_positions=128)
    runs = _runs(monkeypatch)
    native = _forward(model, **step)
    assert runs == [1] and isinstance(model.model._native_layers, NativeLayers)
    # float32 on the native GEMM: residuals added in its store, the MLP's activation inside it
    fused = dtype == torch.float32 and fp32_gemm == "native"
    assert all(layer.fused_mlp == layer.o.fuses_residual == layer.down.fuses_residual == fused for layer in model.model._native_layers.layers)
    model.model._native_layers = False  # the module tree
    modules = _forward(model, **step)
    assert runs == [1]
    assert native.dtype == dtype and torch.equal(native, modules)


# MIXED's last row of each request: the rows a step samples when each request reaches its end.
SAMPLED = torch.tensor([0, 1, 10, 15])


def _last_layer_rows(model, monkeypatch) -> list[int]:
    """The rows each linear layer after the last layer's attention takes, on either path."""
    rows: list[int] = []
    last = model.model.layers[str(len(model.model.layers) - 1)]
    after_attention = {last.self_attn.o_proj, last.mlp.gate_up_proj, last.mlp.down_proj}
    for module in after_attention:
        module.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))
    def recorded(method):
        def call(self, x, *args):
            if any(self.packed is module.packed_weight for module in after_attention):
                rows.append(x.shape[0])
            return method(self, x, *args)

        return call

    # Every GEMM of the plan's linears goes through `gemm`, but for the MLP's fused SiLU-and-multiply.
    monkeypatch.setattr(native_layers._Linear, "gemm", recorded(native_layers._Linear.gemm))
    monkeypatch.setattr(native_layers._Linear, "silu_mul", recorded(native_layers._Linear.silu_mul))
    return rows


@pytest.mark.parametrize("gemm", GEMMS.values(), ids=GEMMS.keys())
@pytest.mark.parametrize("name", ["llama", "qwen2"])
@torch.inference_mode()
def test_the_last_layer_runs_past_its_attention_for_the_sampled_rows_alone(gemm, name, model_dirs, monkeypatch):
    """`sampled_rows` (the model runner's logits indices in a prefill step): the last layer's
    o_proj and MLP take those rows alone, on the native path and on the modules, which still agree
    to the bit; the logits are the whole step's at those rows (to the dtype's rounding: a GEMM's
    bits may depend on its row count)."""
    dtype, fp32_gemm, onednn_bf16 = gemm
    _packing(monkeypatch, fp32_gemm, onednn_bf16)
    model = build(model_dirs[name], dtype, max_positions=128)
    whole = _forward(model, **MIXED)[SAMPLED]
    rows = _last_layer_rows(model, monkeypatch)
    native = _forward(model, sampled_rows=SAMPLED, **MIXED)
    assert isinstance(model.model._native_layers, NativeLayers) and rows == [len(SAMPLED)] * 3
    model.model._native_layers = False  # the module tree
    modules = _forward(model, sampled_rows=SAMPLED, **MIXED)
    assert rows == [len(SAMPLED)] * 6
    assert native.shape == (len(SAMPLED), model.config.vocab_size) and torch.equal(native, modules)
    torch.testing.assert_close(native, whole)


@torch.inference_mode()
def test_the_bfloat16_layers_call_the_kernels_their_modules_do(model_dirs, monkeypatch):
    """The plan's linears pass the plain weight on, so a decode step of a few rows takes the
    small-batch kernel where it is built, as the modules do, and oneDNN (or the widened GEMM) otherwise."""
    model = build(model_dirs["llama"], torch.bfloat16, max_positions=128)
    _forward(model, **DECODE)
    plan = model.model._native_layers
    assert isinstance(plan, NativeLayers)
    linear = plan.layers[0].qkv
    assert not linear.native and linear.plain is model.model.layers["0"].self_attn.qkv_proj.weight
    read = []  # the plain weights the small-batch kernel read (the LM head's among them)
    kernel = cpu_gemm.small_linear
    monkeypatch.setattr(cpu_gemm, "small_linear", lambda x, plain, bias: read.append(plain) or kernel(x, plain, bias))
    _forward(model, **DECODE)  # three rows
    took_kernel = any(weight is linear.plain for weight in read)
    assert took_kernel == (3 in cpu_gemm.kernel_rows())  # AVX-512 BF16: the kernel reads the plain weight


@torch.inference_mode()
def test_per_head_qk_norm_and_unpacked_layers_run_the_modules(model_dirs, monkeypatch):
    runs = _runs(monkeypatch)
    qwen3 = build(model_dirs["qwen3"], torch.float32, max_positions=128)
    _forward(qwen3)
    assert qwen3.model._native_layers is False
    # float16 with neither oneDNN's float16 GEMM nor widening: those layers stay on F.linear.
    monkeypatch.setattr(cpu_gemm, "packs_dtype", lambda dtype: dtype == torch.float32)
    monkeypatch.setenv(cpu_gemm.ENV_WIDE_FP16, "0")
    fp16 = build(model_dirs["llama"], torch.float16, max_positions=128)
    _forward(fp16)
    assert fp16.model._native_layers is False and runs == []


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


@torch.inference_mode()
def test_the_epilogue_benchmark_times_both_ways_and_leaves_them_fused(model_dirs):
    """benchmarks/native_layers.py --epilogues: the plan with and without its fused epilogues,
    the same bits asked of both; the plan fused again after."""
    import argparse

    from native_layers import compare  # benchmarks/native_layers.py (on the path above)

    model = build(model_dirs["llama"], torch.float32, max_positions=128)
    shape = argparse.Namespace(num_seqs=3, min_context=20, max_context=30, prefill_tokens=9)
    input_ids, positions, meta, kv_cache = steps(model, shape, torch.float32)["decode"]
    step = (input_ids % model.config.vocab_size, positions, meta, kv_cache)  # steps() draws ids for a real vocabulary
    result = compare(model, step, repeats=2, epilogues=True)
    assert set(result) >= {"fused_median_ms", "separate_median_ms", "speedup_median"}
    plan = model.model._native_layers
    assert all(layer.fused_mlp and layer.o.fuses_residual and layer.down.fuses_residual for layer in plan.layers)
