"""Greedy float32 outputs equal Hugging Face's on the shapes the fast attention path serves:
head_dim 64 and 128, with 1, 2, 3, 4 and 8 query heads per KV head. (test_hf_exactness's tiny
models have head_dim 16 to 32, which only the portable loop takes.) Each run also asserts, from
the kernel's own path counters, that the vector path (AVX-512, or AVX2 on a CPU without it)
computed every attention task where this machine's build has one: equal outputs alone cannot
show which path made them."""

from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.kernels import cpu_native
from tests.e2e.test_hf_exactness import PREFIX_PROMPTS, PROMPTS, engine_vs_hf
from tests.models import HFReference, build_model

HIDDEN = 96  # transformers wants it a multiple of the head count (2 to 8 here)
GROUPS = {1: (2, 2), 2: (4, 2), 3: (6, 2), 4: (4, 1), 8: (8, 1)}  # query heads per KV head -> (heads, KV heads)
SHAPES = [(head_dim, group) for head_dim in (64, 128) for group in GROUPS]
CONFIGS = {
    "default": {},
    # Chunks of 16 tokens and 10 blocks of 16: prefill in pieces, and the batch keeps preempting
    # (admission reserves no room for outputs).
    "chunked_and_preempting": {"max_num_batched_tokens": 16, "num_gpu_blocks_override": 10, "max_model_len": 160, "schedule_conservativeness": 0},
}


@pytest.fixture(scope="module")
def shaped_models(artifacts, tokenizer_dir) -> dict:
    models = {}
    for head_dim, group in SHAPES:
        heads, kv_heads = GROUPS[group]
        folder = build_model(
            artifacts / f"llama_d{head_dim}_g{group}", "llama", tokenizer_dir,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=HIDDEN,
        )  # fmt: skip
        models[head_dim, group] = (folder, HFReference(folder))
    return models


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("head_dim, group", SHAPES, ids=[f"d{d}_group{g}" for d, g in SHAPES])
def test_fast_path_matches_hf(head_dim, group, config_name, shaped_models):
    folder, hf = shaped_models[head_dim, group]
    llm = LLM(str(folder), **{"max_model_len": 256, "dtype": "float32", **CONFIGS[config_name]})
    try:
        before = cpu_native.attention_path_counts()
        engine_vs_hf(llm, hf, PROMPTS)
        if config_name == "default":  # a second run of a shared prefix reads its blocks from the cache
            engine_vs_hf(llm, hf, PREFIX_PROMPTS)
            engine_vs_hf(llm, hf, PREFIX_PROMPTS)
            assert llm.llm_engine.engine_core.engine_core.kv_cache_manager.num_prefix_hits > 0
        else:
            assert llm.llm_engine.engine_core.engine_core.scheduler.num_preemptions_total > 0
        after = cpu_native.attention_path_counts()
    finally:
        llm.shutdown()
    fast, portable = (after[path] - before[path] for path in ("vector", "portable"))
    if {"avx512", "avx2"} & cpu_native.compiled_paths():
        assert fast > 0 and portable == 0, f"vector-path tasks {fast}, portable-loop tasks {portable}"
    else:  # test_cpu_native checks that this CPU promises neither AVX-512 nor AVX2
        assert fast == 0 and portable > 0
