"""`torch.compile` of the model on the CPU (workers/compile.py): exact, and compiled once per shape kind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.workers.compile import should_compile
from pagedserve.workers.models.llama import attention_dims
from pagedserve.workers.parallel_state import ParallelContext
from tests.kernels.paged_batch import make_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from cpu_forward import build  # noqa: E402  (the model as a CPU worker loads it)

PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 8, 9], list(range(30, 70)), [300, 2, 301, 2, 302, 2, 303, 2, 304]]


def _compiled_forward(llm: LLM):
    """The compiled forward of an in-process engine's only rank."""
    runner = llm.llm_engine.engine_core.engine_core.executor.worker.runner
    return runner.model.compiled_model


def test_compiled_engine_matches_hf_greedy_in_float32(model_dirs, hf_references):
    # qwen3: per-head q/k norms beside the rest. The mixed-batch test below compiles the same
    # graph (same model, shapes and max_model_len), so inductor's cache serves it the second time.
    llm = LLM(str(model_dirs["qwen3"]), dtype="float32", enforce_eager=False, max_model_len=128)
    compiled = _compiled_forward(llm)
    assert compiled is not None
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        assert list(output.outputs[0].token_ids) == hf_references["qwen3"].greedy(prompt, 12)
    # One graph for every step size, a single decode (padded to two tokens) included.
    (single,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert list(single.outputs[0].token_ids) == hf_references["qwen3"].greedy(PROMPTS[0], 12)
    assert compiled.num_compiles == 1
    llm.shutdown()


def _config(**kwargs) -> EngineConfig:
    return EngineConfig(model="unused", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "device", "tp_size", "expected"),
    [
        ({}, "cpu", 1, False),  # the default stays eager
        ({"enforce_eager": True}, "cpu", 1, False),
        ({"enforce_eager": False}, "cpu", 1, True),
        ({"enforce_eager": False}, "cpu", 2, False),  # TP's all-reduce would break the graph
        ({"enforce_eager": False}, "cuda", 1, False),  # CUDA graphs there instead
    ],
)
def test_should_compile(kwargs, device, tp_size, expected):
    parallel = ParallelContext(tp_rank=0, tp_size=tp_size, pp_rank=0, pp_size=1)
    assert should_compile(_config(**kwargs), torch.device(device), parallel) is expected


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
@torch.inference_mode()
def test_compiled_forward_matches_eager_on_a_mixed_batch(model_dirs, dtype, atol):
    """Inductor's fused RMSNorm + residual, RoPE and SiLU-and-mul against the eager layers, on a
    step of two decodes and two prefill chunks (one starting mid-prompt), at each dtype's tolerance."""
    model = build(model_dirs["qwen3"], dtype, max_positions=128)
    compiled_model = build(model_dirs["qwen3"], dtype, max_positions=128, compiled=True)
    num_heads, num_kv_heads, head_dim = attention_dims(model.config)
    query_lens, context_lens = [1, 1, 9, 5], [30, 12, 0, 7]
    batch = make_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype=dtype)
    positions = torch.cat([torch.arange(c, c + q) for q, c in zip(query_lens, context_lens)])
    input_ids = torch.randint(0, model.config.vocab_size, (len(positions),), generator=torch.Generator().manual_seed(0))
    for attn in model.attention_layers():
        attn.kv_cache = batch.kv_cache.clone()
    eager = model(input_ids, positions, batch.meta)
    for attn in compiled_model.attention_layers():
        attn.kv_cache = batch.kv_cache.clone()  # the same cache as the eager pass saw
    compiled = compiled_model(input_ids, positions, batch.meta)
    assert compiled_model.compiled_model.num_compiles == 1
    torch.testing.assert_close(compiled, eager, atol=atol, rtol=atol)
