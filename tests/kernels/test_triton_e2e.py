"""The engine end to end on the Triton kernels: greedy float32 outputs equal Hugging Face's."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86-64 Linux only)")

from pagedserve import LLM, SamplingParams
from tests.kernels.conftest import DEVICE

MAX_TOKENS = 8
PROMPTS = [
    "Hello, my name is",
    "The capital of France is Paris. The capital of Japan is",
    "Once upon a time there was a small server in a quiet data center. It answered questions.",
    "A",
]


@pytest.mark.parametrize(
    "arch, engine_args",
    [
        # GQA; a 16-token budget chunks the longer prompts, so chunks attend to cached context.
        ("llama", {"max_num_batched_tokens": 16}),
        # MQA with head_dim 24 (not a power of two); 8-token blocks.
        ("mistral", {"block_size": 8}),
    ],
)
def test_triton_backend_greedy_matches_hf(arch, engine_args, model_dirs, hf_references):
    llm = LLM(str(model_dirs[arch]), max_model_len=128, attention_backend="triton", dtype="float32", device=DEVICE, **engine_args)
    try:
        assert llm.llm_engine.engine_core.engine_core.executor.worker.runner.backend.name == "triton"
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        for output in llm.generate(PROMPTS, params, use_tqdm=False):
            expected = hf_references[arch].greedy(output.prompt_token_ids, MAX_TOKENS)
            assert output.outputs[0].token_ids == expected, f"prompt {output.prompt!r}"
    finally:
        llm.shutdown()
