"""CUDA graphs for decode steps: which sizes are captured, when graphs are used, and that padded
rows neither write a cache slot nor change a real row's output.

The padding runs through the same Triton kernels a graph replays (in the interpreter on the CPU);
capture and replay themselves need a GPU (the `gpu` tests)."""

from __future__ import annotations

import pytest
import torch

# First: it switches Triton to its interpreter on a CPU machine, which must happen before any
# kernel module is imported (they are decorated at import).
from tests.kernels.conftest import DEVICE  # isort: skip

pytest.importorskip("triton")  # in the test extra only where it has wheels (x86-64 Linux)

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.kernels import get_attention_backend, reference, triton_attention, triton_cache  # noqa: E402
from pagedserve.workers.cuda_graphs import MAX_CAPTURE_SIZE, DecodeBuffers, capture_sizes, graphs_enabled, padded_size  # noqa: E402
from tests.kernels.paged_batch import make_batch  # noqa: E402


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_SIZE


def test_padded_size_is_the_smallest_that_fits():
    sizes = capture_sizes(40)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 33, 40)] == [1, 2, 4, 8, 8, 16, 40, 40]
    assert padded_size(41, sizes) is None


@pytest.mark.parametrize(
    "device, overrides, backend, expected",
    [
        ("cuda", {}, "triton", True),
        ("cuda", {"enforce_eager": True}, "triton", False),
        ("cpu", {}, "triton", False),
        ("cuda", {}, "torch", False),  # the reference reads host lists a graph would freeze
        ("cuda", {"tensor_parallel_size": 2}, "triton", False),
    ],
)
def test_when_graphs_are_used(device, overrides, backend, expected):
    config = EngineConfig(model="unused", **overrides)
    assert graphs_enabled(config, get_attention_backend(backend, DEVICE), torch.device(device)) is expected


def test_padded_rows_write_nothing_and_leave_real_rows_alone():
    """A step of 3 decodes padded to 8 rows, after a step of 6 left its rows in the buffers."""
    buffers = DecodeBuffers(max_size=8, max_blocks_per_seq=12, max_model_len=96, device=torch.device(DEVICE))
    earlier = make_batch([1] * 6, [60, 50, 40, 30, 20, 10], num_heads=4, num_kv_heads=2, block_size=8, device=DEVICE, seed=1)
    buffers.load(torch.arange(6), torch.arange(6), earlier.meta, 8)
    step = make_batch([1] * 3, [70, 33, 0], num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, device=DEVICE, seed=2)
    buffers.load(torch.arange(3), torch.arange(3), step.meta, 8)
    assert buffers.slot_mapping[3:8].tolist() == [-1] * 5 and buffers.seq_lens[3:8].tolist() == [0] * 5

    padded = buffers.meta(8)
    query = torch.cat([step.query, torch.randn(5, 4, 32, device=DEVICE)])
    key = torch.cat([step.key, torch.randn(5, 2, 32, device=DEVICE)])
    value = torch.cat([step.value, torch.randn(5, 2, 32, device=DEVICE)])
    cache = step.kv_cache.clone()
    triton_cache.write_kv_cache(key, value, cache, padded.slot_mapping)
    out = triton_attention.paged_attention(query, key, value, cache, padded, step.scale)

    expected_cache = step.kv_cache.clone()
    reference.write_kv_cache(step.key, step.value, expected_cache, step.meta.slot_mapping)
    assert torch.equal(cache, expected_cache), "a padded row wrote into the cache"
    expected = reference.paged_attention(step.query, step.key, step.value, expected_cache, step.meta, step.scale)
    torch.testing.assert_close(out[:3], expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[3:], torch.zeros_like(out[3:])), "padded rows attend to nothing"


# ---- on a GPU: capture and replay --------------------------------------------------------------

PROMPTS = ["Hello, my name is", "The capital of France is Paris. The capital of Japan is", "A", "café naïve"]


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_gpu_graph_replay_is_greedy_exact(arch, model_dirs, hf_references):
    """Float32 on the GPU: decode steps replay graphs (3 of 4 and 4 of 4 rows, padded), and the
    greedy tokens still equal Hugging Face's."""
    llm = LLM(str(model_dirs[arch]), max_model_len=128, dtype="float32", attention_backend="triton", max_num_seqs=8)
    try:
        runner = llm.llm_engine.engine_core.engine_core.executor.worker.runner
        assert runner.cuda_graphs is not None and sorted(runner.cuda_graphs.graphs) == [1, 2, 4, 8]
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        assert runner.cuda_graphs.num_replays > 0
        for output in outputs:
            assert output.outputs[0].token_ids == hf_references[arch].greedy(output.prompt_token_ids, 16)
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_gpu_enforce_eager_captures_nothing(model_dirs):
    llm = LLM(str(model_dirs["llama"]), max_model_len=128, attention_backend="triton", enforce_eager=True)
    try:
        assert llm.llm_engine.engine_core.engine_core.executor.worker.runner.cuda_graphs is None
    finally:
        llm.shutdown()
