"""Drives a real Scheduler and KVCacheManager with no model: a fake worker stands in for the model
runner, and a checker asserts the scheduler's invariants after every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pagedserve.engine.engine_core_output import StepOutputs
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.step_types.scheduler_output import SchedulerOutput
from pagedserve.sampling_params import SamplingParams

BS = 4  # block size
EOS = 2
FILLER = 7  # a sampled token that stops nothing


def make_scheduler(
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 16,
    chunked: bool = True,
    caching: bool = True,
    block_size: int = BS,
    schedule_conservativeness: float = 0.0,
    min_budget: int | None = None,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(
        kv, budget, max_num_seqs, chunked, schedule_conservativeness=schedule_conservativeness, min_num_batched_tokens=min_budget
    )


def make_request(req_id: str, prompt, max_model_len: int = 128, arrival: float = 0.0, **params) -> Request:
    params.setdefault("max_tokens", 4)
    return Request(req_id, list(prompt), SamplingParams(**params), frozenset({EOS}), max_model_len, arrival)


def prompt(seed: int, length: int) -> list[int]:
    """Distinct token ids per seed (so unrelated prompts never share a block), none a stop token."""
    return [1000 * (seed + 1) + i for i in range(length)]


@dataclass
class _WorkerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    keys: list[int] = field(default_factory=list)  # stand-in K/V of each position

    def key(self, position: int) -> int:
        """A value that depends on the whole prefix up to `position`, as a causal model's K/V does."""
        while len(self.keys) <= position:
            parent = self.keys[-1] if self.keys else 0
            self.keys.append(hash((parent, self.token_ids[len(self.keys)])))
        return self.keys[position]


class FakeWorker:
    """The model runner without a model. It rebuilds each request only from what SchedulerOutput
    sends (full data once, diffs after), writes a fake K/V into the slots of each computed
    position, and checks that every position a request attends over holds the K/V of its own
    prefix: a block handed to two requests, a wrong prefix-cache hit or a lost diff all fail it.
    It samples when a step reaches the end of the known tokens, as workers/step_inputs.py does."""

    def __init__(self, block_size: int = BS, sample: Callable[[str, list[int]], int] | None = None):
        self.block_size = block_size
        self.sample = sample or (lambda req_id, token_ids: FILLER)
        self.slots: dict[tuple[int, int], int] = {}  # (block id, offset) -> key
        self.states: dict[str, _WorkerState] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        for req_id, n in out.num_scheduled_tokens.items():  # every layer writes before it attends
            state = self.states[req_id]
            for pos in range(state.num_computed_tokens, state.num_computed_tokens + n):
                self.slots[self._slot(state, pos)] = state.key(pos)
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            seq_len = state.num_computed_tokens + n
            assert seq_len <= len(state.token_ids), f"{req_id}: computes tokens it does not know"
            for pos in range(seq_len):
                assert self.slots.get(self._slot(state, pos)) == state.key(pos), f"{req_id}: bad K/V at {pos}"
            state.num_computed_tokens = seq_len
            if seq_len == len(state.token_ids):
                req_ids.append(req_id)
                sampled.append(self.sample(req_id, state.token_ids))
        return ModelRunnerOutput(req_ids, sampled)

    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.dropped_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent in full while the worker holds it"
            self.states[new.req_id] = _WorkerState(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
        cached = out.scheduled_cached_reqs
        for req_id, tokens, blocks, num_computed in zip(
            cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.states[req_id]
            assert num_computed == state.num_computed_tokens, f"{req_id}: computed counts disagree"
            state.token_ids.extend(tokens)
            state.block_ids.extend(blocks)

    def _slot(self, state: _WorkerState, pos: int) -> tuple[int, int]:
        return state.block_ids[pos // self.block_size], pos % self.block_size


def step(sched: Scheduler, worker: FakeWorker) -> tuple[SchedulerOutput, StepOutputs]:
    num_preemptions = sched.num_preemptions_total
    out = sched.schedule()
    check_invariants(sched, out, num_preemptions)
    return out, sched.update_from_output(out, worker.execute(out))


def run_to_completion(sched: Scheduler, worker: FakeWorker, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished_requests():
        assert len(outs) < max_steps, "no progress"
        outs.append(step(sched, worker)[0])
    return outs


def assert_no_leak(sched: Scheduler) -> None:
    pool = sched.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert not any(sched.kv_cache_manager.req_to_blocks.values())


def check_invariants(sched: Scheduler, out: SchedulerOutput, num_preemptions_before: int) -> None:
    """What must hold right after `schedule()`, whatever the workload."""
    scheduled = out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens == sum(scheduled.values()) <= sched.max_num_batched_tokens
    assert all(n > 0 for n in scheduled.values())
    assert len(sched.running) <= sched.max_num_seqs
    new_ids = [new.req_id for new in out.scheduled_new_reqs]
    assert sorted(new_ids + out.scheduled_cached_reqs.req_ids) == sorted(scheduled)
    assert not set(new_ids) & out.dropped_req_ids  # never dropped and re-sent in one step
    if new_ids:  # waiting requests only get what running ones left, and never after a preemption
        assert all(r.request_id in scheduled for r in sched.running)
        assert sched.num_preemptions_total == num_preemptions_before
    if not sched.enable_chunked_prefill:  # every request gets its whole gap, never a chunk
        for req_id, n in scheduled.items():
            assert sched.requests[req_id].num_computed_tokens + n == sched.requests[req_id].num_tokens
    if new_ids and sched.reservation is not None and len(sched.running) > 1:
        # The last admission left the running requests room for their expected outputs.
        assert sched.reservation.reserved_blocks(sched.running) <= sched.kv_cache_manager.pool.num_free_blocks
    _check_queues(sched, scheduled)
    _check_blocks(sched, scheduled)


def _check_queues(sched: Scheduler, scheduled: dict[str, int]) -> None:
    running_ids = {r.request_id for r in sched.running}
    assert set(scheduled) <= running_ids
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in sched.waiting)
    for request in sched.running:
        assert request.num_computed_tokens + scheduled.get(request.request_id, 0) <= request.num_tokens
    for request in sched.waiting:
        assert request.num_computed_tokens == 0 and not sched.kv_cache_manager.get_block_ids(request.request_id)
    # Arrival order: running requests started in arrival order and all arrived before any waiting one.
    arrivals = [r.arrival_time for r in sched.running] + [r.arrival_time for r in sched.waiting]
    assert arrivals == sorted(arrivals)


def _check_blocks(sched: Scheduler, scheduled: dict[str, int]) -> None:
    kv, pool = sched.kv_cache_manager, sched.kv_cache_manager.pool
    owners: dict[int, list[tuple[Request, int]]] = {}
    for request in sched.running:
        blocks = kv.req_to_blocks.get(request.request_id, [])
        needed = request.num_computed_tokens + scheduled.get(request.request_id, 0)
        assert len(blocks) == kv.blocks_needed(needed), f"{request}: {len(blocks)} blocks for {needed} tokens"
        for index, block in enumerate(blocks):
            owners.setdefault(block.block_id, []).append((request, index))
    assert sum(len(v) for v in kv.req_to_blocks.values()) == sum(len(v) for v in owners.values())
    for block in pool.blocks:
        users = owners.get(block.block_id, [])
        assert block.ref_cnt == len(users) >= 0
        assert pool.is_free(block.block_id) == (block.ref_cnt == 0)
        if block.block_hash is not None:
            assert pool.registered_blocks[block.block_hash] is block
        if len(users) > 1:  # only a prefix-cached block at the same place in each prompt
            assert block.block_hash is not None
            assert all(r.block_hashes[i] == block.block_hash for r, i in users)
