"""`num_cpu_threads`: the torch threads a CPU engine's process runs the model with."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from pagedserve.workers.model_runner import StepThreads


def test_num_cpu_threads_sets_the_engine_process_threads(model_dirs):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llm = LLM(str(model_dirs["llama"]), max_model_len=64, dtype="float32", num_cpu_threads=1)
        assert torch.get_num_threads() == 1
        llm.shutdown()
    finally:
        torch.set_num_threads(before)


def test_num_cpu_threads_below_one_is_refused(model_dirs):
    with pytest.raises(ValueError, match="num_cpu_threads"):
        LLM(str(model_dirs["llama"]), num_cpu_threads=0)


def test_light_steps_run_on_fewer_threads_and_stay_exact(model_dirs, hf_references):
    """`light_step_cpu_threads`: steps that carry prefill tokens on every thread; decode-only steps
    (six rows, then three) on fewer; float32 greedy output still equals Hugging Face's."""
    from tests.e2e.test_hf_exactness import PROMPTS, engine_vs_hf

    before = torch.get_num_threads()
    try:
        llm = LLM(str(model_dirs["llama"]), max_model_len=128, dtype="float32", num_cpu_threads=2, light_step_cpu_threads=1)
        threads = llm.llm_engine.engine_core.engine_core.executor.worker.runner.step_threads
        seen = []
        original = threads.set_for

        def recording(num_tokens, num_reqs):
            original(num_tokens, num_reqs)
            seen.append((num_tokens, num_reqs, torch.get_num_threads()))

        threads.set_for = recording
        engine_vs_hf(llm, hf_references["llama"], PROMPTS)
        engine_vs_hf(llm, hf_references["llama"], PROMPTS[:3])
        prefill = {n for tokens, reqs, n in seen if tokens > max(reqs, StepThreads.LIGHT_STEP_TOKENS)}
        decode_only = {(reqs, n) for tokens, reqs, n in seen if tokens == reqs}
        assert prefill == {2}
        assert {(len(PROMPTS), 1), (3, 1)} <= decode_only and {n for _, n in decode_only} == {1}
        assert len(PROMPTS) > StepThreads.LIGHT_STEP_TOKENS  # a decode-only step past the few-token rule
        llm.shutdown()
    finally:
        torch.set_num_threads(before)


def _fake_threads(monkeypatch, start: int) -> list[int]:
    """torch's thread count as a number the test owns; returns the list of counts set."""
    current, calls = [start], []
    monkeypatch.setattr(torch, "get_num_threads", lambda: current[0])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), current.__setitem__(0, n)))
    return calls


def test_step_threads_change_only_when_the_step_size_class_does(monkeypatch):
    calls = _fake_threads(monkeypatch, 4)
    threads = StepThreads(full=4, light=8)  # never more than the full count
    assert threads.light == 4
    threads = StepThreads(full=4, light=1)
    light = StepThreads.LIGHT_STEP_TOKENS
    # (tokens, requests): a prefill, few tokens, few tokens, prefill and decodes, few tokens,
    # then decode-only steps of many rows, and a step of many rows with one prefill chunk
    steps = [(512, 1), (light - 1, 1), (light - 2, 2), (light + 1, 2), (light, 1), (300, 3), (200, 200), (128, 128), (129, 128)]
    for num_tokens, num_reqs in steps:
        threads.set_for(num_tokens, num_reqs)
    assert calls == [1, 4, 1, 4, 1, 4]


def test_a_step_thread_whose_count_was_changed_elsewhere_gets_its_own_back(monkeypatch):
    """A step thread whose first parallel op came after another thread set the process-wide
    count to 1 (the LoRA reader does) runs its next step on the engine's count again."""
    calls = _fake_threads(monkeypatch, 1)
    threads = StepThreads(full=2)  # no light steps: every step on both threads
    threads.set_for(300, 2)
    threads.set_for(1, 1)
    threads.set_for(64, 64)
    assert calls == [2]


def test_light_step_threads_below_one_is_refused(model_dirs):
    with pytest.raises(ValueError, match="light_step_cpu_threads"):
        LLM(str(model_dirs["llama"]), light_step_cpu_threads=0)
