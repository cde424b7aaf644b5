"""Property tests of the real Scheduler, KVCacheManager and BlockPool (hypothesis state machine).

Hypothesis draws a scheduler configuration (block size, a pool small enough that requests preempt
each other, budget, chunked prefill, prefix caching) and then random interleavings of:

- add: a request whose prompt often shares a prefix with earlier ones (prefix-cache hits);
- abort / stop string: the engine ends a request from outside the step, between steps;
- step: schedule, run the fake worker, maybe abort while the step runs, update from its output;
- worker loss: the step is scheduled but its executor fails, as `LLMEngine.step` then does:
  `requeue_after_worker_loss()` and a fresh worker group with empty KV caches.

After every rule the block tables and reference counts agree (`_check_blocks`: each block's
ref_cnt is the number of block tables holding it, free blocks are exactly those at zero, shared
blocks are prefix-cached ones), the queues are consistent, and a double free trips BlockPool's
assert. At teardown every request is driven to its end: each ended exactly once (one finish
reason or one abort, no output after it), no worker state survives, no block is leaked and the
KV usage is 0. The fake worker (tests/engine/scheduler_harness.py) checks every K/V position a
request reads, so a block shared wrongly or a lost diff after a requeue fails too.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from tests.engine.core.scheduler_harness import (
    EOS,
    FakeWorker,
    _check_blocks,
    _check_queues,
    assert_no_leak,
    check_invariants,
    make_scheduler,
)

MAX_MODEL_LEN = 32
VOCAB = range(10, 30)  # small, so sampled tokens often recreate prompt blocks
PREFIX_LEN = 24


class SchedulerMachine(RuleBasedStateMachine):
    """One engine's scheduler under a random sequence of engine events."""

    totals: dict[str, int]  # set by the test: what the examples reached, summed

    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        extra_blocks=st.integers(0, 24),
        budget=st.integers(1, 40),
        max_num_seqs=st.integers(1, 6),
        chunked=st.booleans(),
        caching=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def configure(self, block_size, extra_blocks, budget, max_num_seqs, chunked, caching, seed):
        # At least one max-length request fits in the pool alone (the input processor rejects
        # requests that could outgrow it); a few more blocks and several requests must preempt.
        num_blocks = -(-MAX_MODEL_LEN // block_size) + extra_blocks // block_size
        if not chunked:  # without chunking a prompt must fit in one step's budget
            budget = max(budget, MAX_MODEL_LEN)
        self.block_size = block_size
        self.sched = make_scheduler(num_blocks, budget, max_num_seqs, chunked, caching, block_size)
        self.rng = random.Random(seed)  # the fake model's samples
        self.worker = self._new_worker()
        self.prefixes = [[self.rng.choice(VOCAB) for _ in range(PREFIX_LEN)] for _ in range(2)]
        self.requests: dict[str, Request] = {}
        self.streamed: dict[str, list[int]] = {}
        self.endings: dict[str, list[str]] = {}  # req_id -> every way it was seen to end
        self.num_worker_losses = 0

    def _new_worker(self) -> FakeWorker:
        return FakeWorker(self.block_size, sample=lambda *_: EOS if self.rng.random() < 0.1 else self.rng.choice(VOCAB))

    # ---- engine events ----------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from([0, 1]),
        num_shared=st.integers(0, PREFIX_LEN),
        tail=st.lists(st.sampled_from(VOCAB), max_size=7),
        max_tokens=st.integers(1, 12),
        min_tokens=st.integers(0, 3),
        ignore_eos=st.booleans(),
        stop_token=st.none() | st.sampled_from(VOCAB),
    )
    def add(self, prefix, num_shared, tail, max_tokens, min_tokens, ignore_eos, stop_token):
        prompt = self.prefixes[prefix][:num_shared] + tail or [VOCAB[0]]
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(min_tokens, max_tokens),
            ignore_eos=ignore_eos,
            stop_token_ids=None if stop_token is None else [stop_token],
        )
        req_id = f"r{len(self.requests)}"
        request = Request(req_id, prompt, params, frozenset({EOS}), MAX_MODEL_LEN, float(len(self.requests)))
        self.requests[req_id] = request
        self.streamed[req_id] = []
        self.endings[req_id] = []
        self.sched.add_request(request)

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data(), status=st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]))
    def end_from_outside(self, data, status):
        """An abort (client gone) or a stop string found by the detokenizer."""
        self._end_from_outside(data.draw(st.sampled_from(sorted(self.sched.requests))), status)

    @rule(abort_during_step=st.booleans(), data=st.data())
    def step(self, abort_during_step, data):
        out = self._schedule()
        runner_output = self.worker.execute(out)
        if abort_during_step and self.sched.requests:
            self._end_from_outside(data.draw(st.sampled_from(sorted(self.sched.requests))), RequestStatus.FINISHED_ABORTED)
        self._receive(self.sched.update_from_output(out, runner_output))

    @precondition(lambda self: self.sched.has_unfinished_requests())
    @rule()
    def worker_loss(self):
        """The executor raises WorkerGroupError: the step never happened (LLMEngine.step skips
        update_from_output), the scheduler requeues everything and new workers start empty."""
        self._schedule()
        self.sched.requeue_after_worker_loss()
        self.worker = self._new_worker()
        self.num_worker_losses += 1

    # ---- what must always hold ----------------------------------------------------------------

    @invariant()
    def block_tables_match_ref_counts(self):
        _check_queues(self.sched, {})
        _check_blocks(self.sched, {})
        for request in self.sched.requests.values():
            assert not request.is_finished and not self.endings[request.request_id], request

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished_requests():
                break
            out = self._schedule()
            self._receive(self.sched.update_from_output(out, self.worker.execute(out)))
        else:
            raise AssertionError("no progress")
        self.worker.execute(self.sched.schedule())  # delivers the last finished ids
        assert not self.worker.states, f"workers kept {sorted(self.worker.states)}"
        assert_no_leak(self.sched)
        assert self.sched.kv_cache_manager.usage == 0 and not self.sched.requests
        for req_id, request in self.requests.items():
            assert len(self.endings[req_id]) == 1, (request, self.endings[req_id])
            assert request.is_finished and self.streamed[req_id] == request.output_token_ids, request
            ending = self.endings[req_id][0]
            assert ending == "outside" or ending == request.status.finish_reason, (request, ending)
        self.totals["examples"] += 1
        self.totals["requests"] += len(self.requests)
        self.totals["preemptions"] += self.sched.num_preemptions_total
        self.totals["worker_losses"] += self.num_worker_losses
        self.totals["prefix_hits"] += self.sched.kv_cache_manager.num_prefix_hits

    # ---- helpers --------------------------------------------------------------------------

    def _schedule(self):
        num_preemptions = self.sched.num_preemptions_total
        out = self.sched.schedule()
        check_invariants(self.sched, out, num_preemptions)
        return out

    def _end_from_outside(self, req_id: str, status: RequestStatus) -> None:
        self.sched.finish_requests([req_id], status)
        assert self.requests[req_id].status == status
        self.endings[req_id].append("outside")

    def _receive(self, core_outputs) -> None:
        for core in core_outputs:
            assert not self.endings[core.req_id], f"{core.req_id}: output after it ended"
            self.streamed[core.req_id] += core.new_token_ids
            if core.finish_reason:
                self.endings[core.req_id].append(core.finish_reason)


def test_random_interleavings_keep_block_and_request_invariants():
    totals = dict.fromkeys(["examples", "requests", "preemptions", "worker_losses", "prefix_hits"], 0)
    machine = type("Machine", (SchedulerMachine,), {"totals": totals})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=200,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,  # the same examples on every run: CI stays reproducible
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
    # The drawn workloads must reach the paths under test, or the properties prove nothing.
    assert totals["preemptions"] > 100, totals
    assert totals["worker_losses"] > 200, totals
    assert totals["prefix_hits"] > 1000, totals
