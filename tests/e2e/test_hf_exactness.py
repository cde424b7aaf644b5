"""Greedy float32 outputs must equal Hugging Face transformers token for token, for every
architecture, in every scheduling configuration that changes how the KV cache is filled."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.conftest import ARCHITECTURES

MAX_TOKENS = 24
PROMPTS = [
    "Hello, my name is",
    "The capital of France is Paris. The capital of Japan is",
    "Once upon a time there was a small server in a quiet data center. It answered questions about "
    "the weather, the sea, the mountains and the stars.",
    "café naïve 日本語 🙂",
    "def generate(prompts, sampling_params):\n    outputs = []",
    "A",
]
SHARED_PREFIX = (
    "When memory runs out, the newest request gives its blocks back and waits; later it is computed "
    "again from its tokens, which are the only truth the engine keeps. "
)
PREFIX_PROMPTS = [SHARED_PREFIX + tail for tail in ("Why?", "Tell me more.", "What is a block?", "And then")]

# Two float32 implementations of the same model differ only in summation order. Each logit is
# summed over ~100-500 terms per layer; with float32's unit roundoff 2^-24 and logits of order 10,
# order alone moves a logit by about 1e-6 to 1e-5 (the largest gap measured over the tiny models'
# matrix and the head_dim 64/128 models: 1.3e-5). 1e-4 leaves room for that and no more: an RMSNorm
# epsilon of 1e-5 instead of 1e-6 moved them by 6e-4 and flipped no token (tried).
LOGPROB_BOUND = 1e-4

# name -> (engine arguments, prompts)
CONFIGS = {
    "default": ({}, PROMPTS),
    "no_prefix_caching": ({"enable_prefix_caching": False}, PROMPTS),
    "chunked_prefill_budget_16": ({"max_num_batched_tokens": 16}, PROMPTS),
    # 10 blocks of 16 tokens: the longest request needs 5, so the batch keeps preempting once
    # admission stops reserving room for outputs. The cache holds 160 tokens, so max_model_len
    # must not ask for more.
    "forced_preemption": ({"num_gpu_blocks_override": 10, "max_model_len": 160, "schedule_conservativeness": 0}, PROMPTS),
    "max_num_seqs_2": ({"max_num_seqs": 2}, PROMPTS),
    "block_size_8_no_chunking": ({"block_size": 8, "enable_chunked_prefill": False}, PROMPTS),
    # auto's fallbacks where the native kernel cannot be built: the reference and the pure-torch
    # fast path, each with prefill in chunks. The fast path is the CPU's, on a GPU machine too.
    "torch_backend_chunked": ({"attention_backend": "torch", "max_num_batched_tokens": 16}, PROMPTS),
    "cpu_backend_chunked": ({"attention_backend": "cpu", "max_num_batched_tokens": 16, "device": "cpu"}, PROMPTS),
}


def engine_vs_hf(llm: LLM, hf, prompts: list[str]) -> list:
    """Greedy tokens equal HF's, and each token's log-probability is within LOGPROB_BOUND of HF's."""
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0), use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        expected = hf.greedy(output.prompt_token_ids, MAX_TOKENS)
        assert completion.token_ids == expected, f"prompt {output.prompt!r}"
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]
        gaps = [abs(ours - theirs) for ours, theirs in zip(logprobs, hf.greedy_logprobs(output.prompt_token_ids, MAX_TOKENS))]
        assert max(gaps) <= LOGPROB_BOUND, f"prompt {output.prompt!r}: logprobs {max(gaps):.2e} from HF's"
    return outputs


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("config_name", list(CONFIGS))
def test_greedy_matches_hf(arch, config_name, model_dirs, hf_references):
    engine_args, prompts = CONFIGS[config_name]
    llm = LLM(str(model_dirs[arch]), **{"max_model_len": 256, "dtype": "float32", **engine_args})
    try:
        engine_vs_hf(llm, hf_references[arch], prompts)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert (scheduler.reservation is None) == (engine_args.get("schedule_conservativeness") == 0)  # on by default
        if config_name == "forced_preemption":
            # The configuration must really exercise preemption, or this test proves nothing.
            assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions_total > 0
        assert llm.llm_engine.engine_core.engine_core.kv_cache_manager.pool.num_free_blocks == llm.llm_engine.engine_core.engine_core.kv_cache_manager.num_total_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_shared_prefix_hits_cache_on_second_run(arch, model_dirs, hf_references):
    llm = LLM(str(model_dirs[arch]), max_model_len=256, dtype="float32")
    try:
        kv = llm.llm_engine.engine_core.engine_core.kv_cache_manager
        engine_vs_hf(llm, hf_references[arch], PREFIX_PROMPTS)
        hits_after_first = kv.num_prefix_hits
        outputs = engine_vs_hf(llm, hf_references[arch], PREFIX_PROMPTS)
        # The second run finds every full block of each prompt (all but the last token) cached.
        block = llm.llm_engine.config.block_size
        for output in outputs:
            expected = (len(output.prompt_token_ids) - 1) // block * block
            assert output.num_cached_tokens == expected
        assert kv.num_prefix_hits - hits_after_first == sum(o.num_cached_tokens for o in outputs)
    finally:
        llm.shutdown()


def test_prompts_sharing_a_prefix_in_one_batch(model_dirs, hf_references):
    """Requests in the same step may adopt prefix blocks that another of them is just filling."""
    llm = LLM(str(model_dirs["llama"]), max_model_len=256, max_num_batched_tokens=64, dtype="float32")
    try:
        engine_vs_hf(llm, hf_references["llama"], PREFIX_PROMPTS * 2)
    finally:
        llm.shutdown()


def test_mixed_batch_of_token_id_prompts_and_lengths(model_dirs, hf_references, tokenizer):
    """Prompt token ids straight in, lengths from 1 to 200 tokens, in one batch."""
    ids = tokenizer.encode(" ".join(PROMPTS) * 3)
    prompts = [{"prompt_token_ids": ids[:n]} for n in (1, 2, 15, 16, 17, 33, 64, 200)]
    llm = LLM(str(model_dirs["qwen3"]), max_model_len=256, max_num_batched_tokens=100, dtype="float32")
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        for output, prompt in zip(outputs, prompts):
            assert output.prompt_token_ids == prompt["prompt_token_ids"]
            assert output.outputs[0].token_ids == hf_references["qwen3"].greedy(prompt["prompt_token_ids"], MAX_TOKENS)
    finally:
        llm.shutdown()


# Ray TP=2 and PP=2 (worker actors, torch.distributed over gloo) crossed with the schedules that
# fill the cache differently: prefill in chunks of 16 under constant preemption, and a shared
# prefix's second run read from the cache.
RAY_CONFIGS = {
    "chunked_and_preempting": {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 10, "max_model_len": 160, "schedule_conservativeness": 0},
    "prefix_hits": {},
}


@pytest.mark.parametrize("config_name", list(RAY_CONFIGS))
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_ray_parallel_matches_hf_across_schedules(ray_cluster, tp, pp, config_name, model_dirs, hf_references):
    engine_args = {"max_model_len": 256, "dtype": "float32", **RAY_CONFIGS[config_name]}
    llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=tp, pipeline_parallel_size=pp, **engine_args)
    try:
        core = llm.llm_engine.engine_core.engine_core
        if config_name == "prefix_hits":
            engine_vs_hf(llm, hf_references["llama"], PREFIX_PROMPTS)
            outputs = engine_vs_hf(llm, hf_references["llama"], PREFIX_PROMPTS)
            assert all(output.num_cached_tokens > 0 for output in outputs)
        else:
            engine_vs_hf(llm, hf_references["llama"], PROMPTS)
            assert core.scheduler.num_preemptions_total > 0
        assert type(core.executor).__name__ == "RayExecutor"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("gemm", ["native", "onednn"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_hf_on_each_fp32_gemm(arch, gemm, model_dirs, hf_references, monkeypatch):
    """float32 linears run on pagedserve's own GEMM where the CPU has no AVX-512 and on oneDNN's
    where it does (cpu_gemm.fp32_gemm): both are held to HF's tokens on whatever CPU runs this."""
    from pagedserve.workers.layers import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "_fp32_gemm", [gemm])
    llm = LLM(str(model_dirs[arch]), max_model_len=256, dtype="float32", device="cpu")
    try:
        model = llm.llm_engine.engine_core.engine_core.executor.worker.runner.model
        assert isinstance(model.lm_head.packed_weight, cpu_gemm.NativeWeight) == (gemm == "native")
        engine_vs_hf(llm, hf_references[arch], PROMPTS)
    finally:
        llm.shutdown()
