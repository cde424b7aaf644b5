"""Adapters are read off the step: a request whose adapter is not yet read waits while every
rank reads it on a thread of its own, and the other requests keep decoding; the read adapter is
then the same weights a read in the step would give, and the output stays PEFT's."""

from __future__ import annotations

import time

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.core.request import RequestStatus
from pagedserve.workers.lora import manager as lora_manager
from tests.lora.conftest import lora_request

SLOW_READ_S = 1.0
PROMPT = "The capital of France is Paris. The capital of Japan is"


@pytest.fixture
def slow_reads(monkeypatch):
    """Every adapter read takes SLOW_READ_S longer, as from a slow disk."""
    real = lora_manager.read_adapter

    def slow(spec):
        time.sleep(SLOW_READ_S)
        return real(spec)

    monkeypatch.setattr(lora_manager, "read_adapter", slow)


def test_a_slow_adapter_read_holds_up_nobody(model_dirs, lora_adapters, lora_references, slow_reads):
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    tokenizer = engine.get_tokenizer()
    try:
        engine.add_request("base", PROMPT, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        while not any(o.outputs[0].token_ids for o in engine.step()):
            pass
        engine.add_request("adapted", PROMPT, SamplingParams(temperature=0.0, max_tokens=8), lora_request=lora_request(lora_adapters["llama"], "all8"))
        finals, longest_step, base_tokens_while_reading = {}, 0.0, 0
        while engine.has_unfinished_requests():
            reading = scheduler.requests.get("adapted") is not None and scheduler.requests["adapted"].status == RequestStatus.WAITING
            started = time.monotonic()
            outputs = engine.step()
            longest_step = max(longest_step, time.monotonic() - started)
            base_tokens_while_reading += reading * sum(1 for o in outputs if o.request_id == "base")
            finals.update({o.request_id: o for o in outputs if o.finished})
    finally:
        llm.shutdown()
    # The read took a second on the worker's reader thread; no step waited for it.
    assert longest_step < SLOW_READ_S / 2, f"a step took {longest_step:.2f} s"
    assert base_tokens_while_reading >= 5
    prompt_ids = tokenizer.encode(PROMPT)
    assert finals["adapted"].outputs[0].token_ids == lora_references[("llama", "all8")].greedy(prompt_ids, 8)
    expected = lora_references[("llama", None)].greedy(prompt_ids, 200)  # HF stops at EOS; the base request ignores it
    assert finals["base"].outputs[0].token_ids[: len(expected)] == expected


def test_an_adapter_read_ahead_is_the_adapter_read_in_the_step(model_dirs, lora_adapters):
    """The manager's two ways in give the same weights on every adapted module: read ahead
    (prefetch, then installed by ensure) and read in the step (ensure alone, as on a rank that
    never heard of the adapter)."""
    request = lora_request(lora_adapters["llama"], "qv4")
    weights = []
    for read_ahead in (True, False):
        llm = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8)
        try:
            manager = llm.llm_engine.engine_core.engine_core.executor.worker.runner.lora_manager
            if read_ahead:
                manager.prefetch([request])
                manager.reading[request.lora_int_id].result(timeout=60)
                assert request.lora_int_id in manager.ready_ids() and request.lora_int_id not in manager.resident
            manager.ensure([request], set())
            assert list(manager.resident) == [request.lora_int_id] and not manager.reading
            weights.append([m.lora_weights[request.lora_int_id] for m in manager._modules() if request.lora_int_id in m.lora_weights])
        finally:
            llm.shutdown()
    assert len(weights[0]) == len(weights[1]) > 0
    # A fused layer keeps each projection's B apart, without zeros between them: the resident
    # adapter weighs what PEFT's own A and B weigh in float32.
    spec = lora_manager.check_adapter(request.lora_path, 8)
    peft_bytes = sum(a.numel() + b.numel() for a, b in lora_manager.read_adapter(spec).values()) * 4
    assert sum(w.nbytes for w in weights[0]) == peft_bytes
    for first, second in zip(*weights):
        assert first.parts == second.parts
        assert all(torch.equal(t0, t1) for t0, t1 in zip(first.tensors(), second.tensors()))


def test_a_removed_adapter_leaves_the_workers_once_its_requests_end(model_dirs, lora_adapters, lora_references):
    """remove_lora reaches the workers: a request already running under the adapter finishes under
    it, exact; the next step after it drops the weights from every layer; named again (same id and
    path), the adapter is read again and still exact."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    engine = llm.llm_engine
    manager = engine.engine_core.engine_core.executor.worker.runner.lora_manager
    adapter = lora_request(lora_adapters["llama"], "all8")
    reference = lora_references[("llama", "all8")]
    prompt_ids = engine.get_tokenizer().encode(PROMPT)
    try:
        engine.add_request("a", PROMPT, SamplingParams(temperature=0.0, max_tokens=12), lora_request=adapter)
        outputs = []
        while not outputs or not outputs[-1].outputs[0].token_ids:
            outputs = [o for o in engine.step() if o.request_id == "a"] or outputs
        assert engine.remove_lora(adapter.lora_int_id) and adapter.lora_int_id not in engine.list_loras()
        final = None
        while final is None:
            final = next((o for o in engine.step() if o.finished), None)
            if final is None:  # still running: its weights stay
                assert adapter.lora_int_id in manager.resident
        assert final.outputs[0].token_ids == reference.greedy(prompt_ids, 12)
        llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # any next step
        assert adapter.lora_int_id not in manager.resident
        assert not any(adapter.lora_int_id in module.lora_weights for module in manager._modules())
        again = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12), lora_request=adapter, use_tqdm=False)
        assert again[0].outputs[0].token_ids == reference.greedy(prompt_ids, 12)
    finally:
        llm.shutdown()


def test_a_read_nobody_installs_never_keeps_the_others_out(model_dirs, lora_adapters):
    """One slot: an adapter read for a request that went away (aborted while waiting) must not
    hold the only place, or the next adapter's request would wait for ever."""
    llm = LLM(str(model_dirs["llama"]), dtype="float32", max_model_len=128, enable_lora=True, max_loras=1, max_lora_rank=8)
    try:
        manager = llm.llm_engine.engine_core.engine_core.executor.worker.runner.lora_manager
        assert manager.read_capacity == 1
        first, second = (lora_request(lora_adapters["llama"], name) for name in ("all8", "qv4"))
        manager.prefetch([first])
        manager.reading[first.lora_int_id].result(timeout=60)
        manager.prefetch([second])  # the first's request is gone: the step names only the second
        assert list(manager.reading) == [second.lora_int_id]
        manager.reading[second.lora_int_id].result(timeout=60)
        assert manager.ready_ids() == {second.lora_int_id}
    finally:
        llm.shutdown()


def test_the_reader_thread_runs_torch_on_one_thread(model_dirs, lora_adapters):
    """A reader thread whose torch ops used a team of OpenMP threads of its own slowed every
    small op of the step thread 10-20x while it lived (measured on 2 cores: an index_add_ of 2
    rows took 8 us before the first adapter read and 190-250 us after), which is all of a LoRA
    step's products. The reader keeps one thread; the step thread keeps its own count."""
    llm = LLM(str(model_dirs["llama"]), max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=16, dtype="float32",
              num_cpu_threads=2, device="cpu")
    try:
        manager = llm.llm_engine.engine_core.engine_core.executor.worker.runner.lora_manager
        manager.prefetch([lora_request(lora_adapters["llama"], "all8")])
        assert manager._reader.submit(torch.get_num_threads).result(timeout=60) == 1
        assert torch.get_num_threads() == 2
    finally:
        llm.shutdown()
