"""Multi-LoRA greedy in float32 equals PEFT's merged model in HF, token for token: one batch
mixes rows of different adapters (ranks 8, 4 with rsLoRA, 2; all linear layers, q/v only, two MLP
projections) and of the base model, in every scheduler configuration; with fewer adapter slots
than adapters; the same prompt under two adapters shares no cached block."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.e2e.test_hf_exactness import PREFIX_PROMPTS, PROMPTS
from tests.lora.conftest import ADAPTERS, lora_request

MAX_TOKENS = 16
NAMES = [None, *ADAPTERS]  # None: the base model, in the same batch
CONFIGS = {
    "default": {},
    "chunked_prefill_budget_16": {"max_num_batched_tokens": 16},
    "forced_preemption": {"num_gpu_blocks_override": 10, "max_model_len": 160, "schedule_conservativeness": 0},
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def run_and_check(llm: LLM, arch: str, adapters, references, prompts: list[str]) -> list:
    cases = [(prompt, name) for prompt in prompts for name in NAMES]
    outputs = llm.generate([p for p, _ in cases], GREEDY, use_tqdm=False, lora_request=[lora_request(adapters, n) for _, n in cases])
    for (prompt, name), output in zip(cases, outputs):
        expected = references[(arch, name)].greedy(output.prompt_token_ids, MAX_TOKENS)
        assert output.outputs[0].token_ids == expected, (name, prompt)
    return outputs


def test_the_adapters_change_the_output(lora_references, model_dirs):
    """(Otherwise the exactness below would prove nothing.)"""
    ids = lora_references[("llama", None)].model.config.bos_token_id
    prompt = [ids or 1, 5, 6, 7]
    base = lora_references[("llama", None)].greedy(prompt, MAX_TOKENS)
    assert all(lora_references[("llama", name)].greedy(prompt, MAX_TOKENS) != base for name in ADAPTERS)


@pytest.mark.parametrize("arch, config_name", [("llama", name) for name in CONFIGS] + [("qwen2", "default")])
def test_mixed_batch_matches_peft_merged(arch, config_name, model_dirs, lora_adapters, lora_references):
    settings = {"max_model_len": 256, **CONFIGS[config_name]}
    llm = LLM(str(model_dirs[arch]), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, **settings)
    try:
        outputs = run_and_check(llm, arch, lora_adapters[arch], lora_references, PROMPTS)
        if config_name == "chunked_prefill_budget_16":
            assert max(len(o.prompt_token_ids) for o in outputs) > 16
        core = llm.llm_engine.engine_core.engine_core
        if config_name == "forced_preemption":
            assert core.scheduler.num_preemptions_total > 0
        assert core.kv_cache_manager.pool.num_free_blocks == core.kv_cache_manager.num_total_blocks
    finally:
        llm.shutdown()


def test_more_adapters_than_slots_waits_and_stays_exact(model_dirs, lora_adapters, lora_references):
    """One slot for three adapters: requests of the others wait (never fail); the worker keeps
    two at most (on the CPU attached, on a GPU one attached and two in host memory) and loads
    the others again."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=256, enable_lora=True, max_loras=1, max_cpu_loras=2)
    try:
        run_and_check(llm, "llama", lora_adapters["llama"], lora_references, PROMPTS[:3])
        manager = llm.llm_engine.engine_core.engine_core.executor.worker.runner.lora_manager
        assert len(manager.resident) <= manager.slots and len(manager.host) <= manager.host_capacity
        assert (manager.slots, manager.host_capacity) == ((1, 2) if manager.tiered else (2, 0))
    finally:
        llm.shutdown()


def test_prefix_hits_stay_within_an_adapter(model_dirs, lora_adapters, lora_references):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=256, enable_lora=True, max_loras=3)
    try:
        first = run_and_check(llm, "llama", lora_adapters["llama"], lora_references, PREFIX_PROMPTS)
        second = run_and_check(llm, "llama", lora_adapters["llama"], lora_references, PREFIX_PROMPTS)
        assert all(o.num_cached_tokens > 0 for o in second)
        # In the first run, the prompts' shared prefix was cached per adapter, never across.
        by_name = {name: [o for o, (_, n) in zip(first, [(p, n) for p in PREFIX_PROMPTS for n in NAMES]) if n == name] for name in NAMES}
        assert all(by_name[name][0].num_cached_tokens == 0 for name in NAMES)
    finally:
        llm.shutdown()
