"""Constrained float32 greedy equals the reference (Hugging Face logits masked by xgrammar's own
GrammarMatcher, argmax, token by token) in every scheduling configuration, with constrained and
unconstrained requests in one batch; the unconstrained ones stay equal to plain HF greedy."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from tests.e2e.test_hf_exactness import PREFIX_PROMPTS, PROMPTS
from tests.engine.structured_outputs.conftest import SPECS

MAX_TOKENS = 32
# qwen2's embedding is padded past the tokenizer (576 rows, 512 tokens): the bitmask must mask it.
PADDED = "qwen2"
CONFIGS = {
    "default": {},
    "chunked_prefill_budget_16": {"max_num_batched_tokens": 16},
    # 10 blocks of 16 tokens for 24 requests: the batch keeps preempting (test_hf_exactness's).
    "forced_preemption": {"num_gpu_blocks_override": 10, "max_model_len": 160, "schedule_conservativeness": 0},
}
KINDS = [*SPECS, None]  # None: an unconstrained request in the same batch


def params_for(kind: str | None) -> SamplingParams:
    so = StructuredOutputsParams(**{kind: SPECS[kind]}) if kind else None
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so)


def run_and_check(llm: LLM, reference, hf, prompts: list[str]) -> list:
    """Every prompt with every kind, all in one batch; each output checked against its reference."""
    cases = [(prompt, kind) for prompt in prompts for kind in KINDS]
    outputs = llm.generate([p for p, _ in cases], [params_for(k) for _, k in cases], use_tqdm=False)
    for (prompt, kind), output in zip(cases, outputs):
        got = output.outputs[0].token_ids
        if kind is None:
            assert got == hf.greedy(output.prompt_token_ids, MAX_TOKENS), prompt
        else:
            assert got == reference.greedy(output.prompt_token_ids, kind, SPECS[kind], MAX_TOKENS), (kind, prompt)
    return outputs


# Every configuration on the padded model; the default one on another architecture too.
@pytest.mark.parametrize("arch, config_name", [(PADDED, name) for name in CONFIGS] + [("llama", "default")])
def test_constrained_greedy_matches_reference(arch, config_name, model_dirs, hf_references, grammar_references):
    llm = LLM(str(model_dirs[arch]), **{"max_model_len": 256, "dtype": "float32", **CONFIGS[config_name]})
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preempted: list = []
    preempt = scheduler._preempt
    scheduler._preempt = lambda request: (preempted.append(request), preempt(request))[1]
    try:
        outputs = run_and_check(llm, grammar_references[arch], hf_references[arch], PROMPTS)
        if config_name == "forced_preemption":  # constrained requests really were recomputed
            assert any(r.grammar is not None and r.num_output_tokens > 0 for r in preempted)
        if config_name == "chunked_prefill_budget_16":
            assert max(len(o.prompt_token_ids) for o in outputs) > 16
        assert any(o.outputs[0].finish_reason == "stop" for o in outputs)  # some grammar completed
        kv = llm.llm_engine.engine_core.engine_core.kv_cache_manager
        assert kv.pool.num_free_blocks == kv.num_total_blocks
        assert scheduler.num_constrained == 0
    finally:
        llm.shutdown()


def test_prefix_cache_hits_stay_exact(model_dirs, hf_references, grammar_references):
    arch = PADDED
    llm = LLM(str(model_dirs[arch]), max_model_len=256, dtype="float32")
    try:
        run_and_check(llm, grammar_references[arch], hf_references[arch], PREFIX_PROMPTS)
        outputs = run_and_check(llm, grammar_references[arch], hf_references[arch], PREFIX_PROMPTS)
        assert all(o.num_cached_tokens > 0 for o in outputs)
    finally:
        llm.shutdown()


# Float32 logits from two implementations of the same model differ by about 1e-6 relative
# (another summation order); through a log-softmax over this vocabulary that stays far below
# 1e-4, while a logprob taken before the mask differs by the log of the forbidden mass: the
# tiny models' random weights spread it over hundreds of tokens, so nearly all of it.
LOGPROB_ATOL = 1e-4


@pytest.mark.parametrize("kind", ["json", "choice"])
def test_constrained_logprobs_are_the_masked_distribution(kind, model_dirs, grammar_references):
    """A constrained request's logprobs (the sampled token's and the top alternatives') are
    HF's log-softmax after the grammar's mask: forbidden tokens never appear among them."""
    arch = PADDED
    llm = LLM(str(model_dirs[arch]), max_model_len=256, dtype="float32")
    try:
        params = params_for(kind)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, structured_outputs=params.structured_outputs)
        [output] = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    finally:
        llm.shutdown()
    completion = output.outputs[0]
    expected = grammar_references[arch].masked_logprobs(output.prompt_token_ids, kind, SPECS[kind], completion.token_ids)
    for position, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = expected[position]
        for alternative_id, logprob in entry.items():
            if row[alternative_id] == float("-inf"):  # fewer allowed tokens than asked for
                assert logprob.logprob == float("-inf"), (position, alternative_id)
            else:
                assert abs(logprob.logprob - float(row[alternative_id])) < LOGPROB_ATOL, (position, alternative_id)
        assert entry[token_id].rank == 1  # greedy: the best allowed token
