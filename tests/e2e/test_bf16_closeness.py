"""bf16 against Hugging Face in bf16, on SmolLM2-135M (head_dim 64, 3 query heads per KV head: the
attention's AVX-512 path), with each CPU attention backend: the paths every speed figure runs.
The float32 tests pin exactness; these pin that the half-precision fast paths compute the same
model, within bf16's own rounding (benchmarks/bf16_check.py derives the bounds).

Each backend's greedy completions come from decode batches of eight rows (oneDNN's packed GEMM)
and of three (the light-step linear, where the CPU has AVX-512 BF16); HF is teacher-forced on
them. A prefill-only run teacher-forces the engine on HF's own greedy tokens: each prefix of HF's
completion is a prompt, and the engine's next token and its logprob are compared there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.e2e.test_real_model import CHATS, PLAIN

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bf16_check import closeness, load_hf_pair  # noqa: E402

MAX_TOKENS = 32
FORCED_POSITIONS = 24  # prefixes of HF's completion of each prompt
BACKENDS = ["native", "cpu", "torch"]


@pytest.fixture(scope="module")
def hf_pair(smollm2_dir):
    return load_hf_pair(str(smollm2_dir))


@pytest.fixture(scope="module")
def hf_cache() -> dict:
    return {}  # HF's passes, shared by the backends' checks


@pytest.fixture(scope="module")
def prompts(hf_pair) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_pair[0].name_or_path)
    chats = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in CHATS]
    return [tokenizer.encode(text, add_special_tokens=False) for text in chats] + [tokenizer.encode(text) for text in PLAIN]


@pytest.fixture(scope="module")
def hf_completions(hf_pair, prompts) -> list[list[int]]:
    """HF bf16's own greedy tokens for each prompt."""
    completions = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf_pair[0].generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=FORCED_POSITIONS, do_sample=False)
            completions.append(out[0, len(prompt):].tolist())
    return completions


def own_completions(outputs) -> list:
    """Samples of the engine's own completions: the context forced on HF is the engine's."""
    samples = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        samples.append((output.prompt_token_ids, list(completion.token_ids), list(completion.token_ids), logprobs))
    return samples


def forced_on(prompts, completions, outputs) -> list:
    """Samples of the engine teacher-forced on HF's completions: one output per prefix, in order."""
    outputs, samples = iter(outputs), []
    for prompt, completion in zip(prompts, completions):
        steps = [next(outputs).outputs[0] for _ in completion]
        chosen = [step.token_ids[0] for step in steps]
        samples.append((prompt, completion, chosen, [step.logprobs[0][token].logprob for step, token in zip(steps, chosen)]))
    return samples


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_greedy_is_hf_bf16_within_its_rounding(backend, smollm2_dir, hf_pair, hf_cache, prompts, hf_completions):
    llm = LLM(str(smollm2_dir), dtype="bfloat16", attention_backend=backend, max_model_len=512)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
        as_prompts = lambda ids: [{"prompt_token_ids": p} for p in ids]  # noqa: E731
        decoded = own_completions(llm.generate(as_prompts(prompts), greedy, use_tqdm=False))  # 8 rows a step
        decoded += own_completions(llm.generate(as_prompts(prompts[4:7]), greedy, use_tqdm=False))  # 3 rows
        # Teacher-forced on HF's tokens: every prefix of HF's completion is a prompt, one token each.
        prefixes = [p + c[:i] for p, c in zip(prompts, hf_completions) for i in range(len(c))]
        one_token = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
        forced = forced_on(prompts, hf_completions, llm.generate(as_prompts(prefixes), one_token, use_tqdm=False))
    finally:
        llm.shutdown()
    for name, samples in (("decode", decoded), ("teacher-forced prefill", forced)):
        result = closeness(*hf_pair, samples, hf_cache)
        print(f"{backend} {name}: {result.summary()}")
        assert result.passed, f"{backend} {name}: {result.summary()}"
