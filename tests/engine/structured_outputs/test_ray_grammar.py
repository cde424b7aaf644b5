"""Constrained greedy on Ray workers. With tensor parallelism the bitmask crosses the step
channel, the vocabulary-parallel logits (an odd 579 rows, 512 of them the tokenizer's) are masked
on the sampling rank, and a worker killed mid-JSON is rebuilt without disturbing any grammar: the
state lives beside the scheduler and follows the output tokens, which the recomputation keeps.
With pipeline parallelism the mask reaches the last stage, the one that samples."""

from __future__ import annotations

import os
import signal

import pytest

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from tests.engine.structured_outputs.conftest import SPECS
from tests.engine.structured_outputs.grammar_reference import GrammarReference
from tests.models import HFReference, build_model

PROMPTS = ["Hello, my name is", "The capital of France is Paris. The capital of Japan is", "A"]
KINDS = ["json", "regex", "choice", None]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def odd_vocab_model(artifacts, tokenizer_dir):
    folder = build_model(artifacts / "qwen2_odd_vocab_grammar", "qwen2", tokenizer_dir, vocab_size=579)
    return folder, GrammarReference(folder), HFReference(folder)


def run_and_check(llm: LLM, reference: GrammarReference, hf: HFReference, on_step=lambda step: None) -> None:
    """Every prompt with every kind in one batch, stepped by hand; each output checked."""
    engine = llm.llm_engine
    cases = {}
    for i, (prompt, kind) in enumerate((p, k) for p in PROMPTS for k in KINDS):
        so = StructuredOutputsParams(**{kind: SPECS[kind]}) if kind else None
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so))
        cases[str(i)] = (engine.engine_core.engine_core.scheduler.requests[str(i)].prompt_token_ids, kind)
    step, finals = 0, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.outputs[0].token_ids
        step += 1
        on_step(step)
    for request_id, (prompt_ids, kind) in cases.items():
        if kind is None:
            assert finals[request_id] == hf.greedy(prompt_ids, MAX_TOKENS), request_id
        else:
            assert finals[request_id] == reference.greedy(prompt_ids, kind, SPECS[kind], MAX_TOKENS), (kind, request_id)


def test_tp2_matches_reference_and_survives_a_worker_loss(ray_cluster, odd_vocab_model):
    folder, reference, hf = odd_vocab_model
    llm = LLM(str(folder), max_model_len=256, tensor_parallel_size=2)
    try:
        victim = llm.llm_engine.engine_core.engine_core.executor.worker_pids()[1]

        def kill_mid_json(step: int) -> None:
            if step == 8:  # mid-way through every JSON object
                os.kill(victim, signal.SIGKILL)

        run_and_check(llm, reference, hf, kill_mid_json)
        assert llm.llm_engine.engine_core.engine_core.num_worker_restarts == 1
    finally:
        llm.shutdown()


def test_pp2_matches_reference(ray_cluster, odd_vocab_model):
    folder, reference, hf = odd_vocab_model
    llm = LLM(str(folder), max_model_len=256, pipeline_parallel_size=2)
    try:
        run_and_check(llm, reference, hf)
    finally:
        llm.shutdown()
