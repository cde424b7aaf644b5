"""The persistent InputBatch against a fresh build_step_inputs, step after step.

A seeded random schedule adds requests (some with prefix-cache hits), decodes them, runs prefill
chunks, drops finished ones, preempts and later resumes others under the same id, and appends
blocks; the batch starts with too few rows and too narrow arrays, so it grows on the way. After
every step its inputs must equal those built from scratch out of plain per-request state."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.step_types.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.workers.input_batch import InputBatch
from pagedserve.workers.step_inputs import CachedRequestState, StepInputs
from tests.workers.step_inputs_reference import build_step_inputs

BLOCK_SIZE = 4
CPU = torch.device("cpu")


class Request:
    """The scheduler's truth for one request, as the simulated schedule sees it."""

    def __init__(self, req_id: str, prompt: list[int]):
        self.req_id = req_id
        self.tokens = list(prompt)
        self.num_prompt = len(prompt)
        self.num_computed = 0
        self.blocks: list[int] = []
        self.num_tokens_on_workers = 0


class Simulation:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.running: dict[str, Request] = {}
        self.preempted: list[Request] = []
        self.next_id = 0
        self.next_block = 1

    def step(self) -> SchedulerOutput:
        rng = self.rng
        finished, preempted = set(), set()
        for req_id in list(self.running):
            if rng.random() < 0.1:
                finished.add(req_id)
                del self.running[req_id]
            elif rng.random() < 0.08:
                request = self.running.pop(req_id)
                request.num_computed, request.blocks = 0, []
                preempted.add(req_id)
                self.preempted.append(request)
        counts: dict[str, int] = {}
        diffs = CachedRequestData()
        for request in self.running.values():
            num_new = self._num_new(request)
            counts[request.req_id] = num_new
            diffs.req_ids.append(request.req_id)
            diffs.new_token_ids.append(request.tokens[request.num_tokens_on_workers :])
            diffs.new_block_ids.append(self._allocate(request, num_new))
            diffs.num_computed_tokens.append(request.num_computed)
            request.num_tokens_on_workers = len(request.tokens)
        new_reqs = [self._admit(request, counts) for request in self._arrivals(preempted)]
        return SchedulerOutput(new_reqs, diffs, counts, sum(counts.values()), finished, preempted)

    def advance(self, output: SchedulerOutput) -> None:
        """The step ran: computed counts move on, and requests that reached their end sample."""
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = self.running[req_id]
            request.num_computed += num_new
            if request.num_computed == len(request.tokens):
                request.tokens.append(self.rng.randint(1, 999))

    def _arrivals(self, just_preempted: set[str]) -> list[Request]:
        arrivals = [Request(f"r{self.next_id + i}", self._prompt()) for i in range(self.rng.randint(0, 3))]
        self.next_id += len(arrivals)
        resumable = [r for r in self.preempted if r.req_id not in just_preempted]
        resumed = [r for r in resumable if self.rng.random() < 0.5]
        self.preempted = [r for r in self.preempted if r not in resumed]
        return resumed + arrivals

    def _prompt(self) -> list[int]:
        return [self.rng.randint(1, 999) for _ in range(self.rng.randint(1, 23))]

    def _admit(self, request: Request, counts: dict[str, int]) -> NewRequestData:
        max_hit_blocks = (len(request.tokens) - 1) // BLOCK_SIZE
        request.num_computed = self.rng.randint(0, max_hit_blocks) * BLOCK_SIZE  # prefix hits
        num_new = self._num_new(request)
        self._allocate(request, num_new)
        counts[request.req_id] = num_new
        request.num_tokens_on_workers = len(request.tokens)
        self.running[request.req_id] = request
        return NewRequestData(
            request.req_id, list(request.tokens), request.num_prompt, SamplingParams(), list(request.blocks), request.num_computed
        )

    def _num_new(self, request: Request) -> int:
        gap = len(request.tokens) - request.num_computed
        return gap if gap == 1 else self.rng.randint(1, gap)  # a whole prompt or a chunk of it

    def _allocate(self, request: Request, num_new: int) -> list[int]:
        needed = -(-(request.num_computed + num_new) // BLOCK_SIZE) - len(request.blocks)
        new_blocks = list(range(self.next_block, self.next_block + max(needed, 0)))
        self.next_block += len(new_blocks)
        request.blocks += new_blocks
        return new_blocks


def apply_to_plain_states(states: dict[str, CachedRequestState], output: SchedulerOutput) -> None:
    """How the model runner kept its requests before the InputBatch: a dict of plain states."""
    for req_id in output.dropped_req_ids:
        states.pop(req_id, None)
    for new in output.scheduled_new_reqs:
        states[new.req_id] = CachedRequestState(
            new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params, list(new.block_ids), new.num_computed_tokens
        )
    cached = output.scheduled_cached_reqs
    for req_id, tokens, blocks, num_computed in zip(cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens):
        states[req_id].token_ids.extend(tokens)
        states[req_id].block_ids.extend(blocks)
        states[req_id].num_computed_tokens = num_computed


def assert_same_inputs(got: StepInputs, want: StepInputs) -> None:
    for name in ("input_ids", "positions", "logits_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        a, b = getattr(got.meta, name), getattr(want.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("num_decodes", "max_query_len", "max_seq_len", "query_start_loc_host", "seq_lens_host"):
        assert getattr(got.meta, name) == getattr(want.meta, name), name
    assert [s.req_id for s in got.sampled_states] == [s.req_id for s in want.sampled_states]
    for a, b in zip(got.sampled_states, want.sampled_states):
        assert (a.token_ids, a.block_ids, a.num_computed_tokens) == (b.token_ids, b.block_ids, b.num_computed_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_persistent_batch_matches_a_fresh_build_every_step(seed):
    simulation = Simulation(seed)
    batch = InputBatch(BLOCK_SIZE, CPU, max_num_reqs=2, max_tokens=4)
    plain: dict[str, CachedRequestState] = {}
    num_checked = num_preempted = num_resumed = 0
    for _ in range(120):
        output = simulation.step()
        batch.update(output)
        apply_to_plain_states(plain, output)
        assert set(batch.states) == set(plain)
        num_preempted += len(output.preempted_req_ids)
        num_resumed += sum(1 for new in output.scheduled_new_reqs if new.token_ids[new.num_prompt_tokens :])
        if output.total_num_scheduled_tokens:
            assert_same_inputs(batch.prepare(output), build_step_inputs(output, plain, BLOCK_SIZE, CPU))
            num_checked += 1
        simulation.advance(output)
    # The schedule really exercised what it is meant to: growth, preemption and resumption.
    assert num_checked > 100 and num_preempted > 0 and num_resumed > 0
    assert len(batch.row_states) > 2 and batch.token_ids.shape[1] > 4


def test_rows_of_dropped_requests_are_reused():
    batch = InputBatch(BLOCK_SIZE, CPU, max_num_reqs=2)
    for req_id in ("a", "b"):
        batch.add(NewRequestData(req_id, [1, 2, 3], 3, SamplingParams(), [1], 0))
    batch.remove("a")
    batch.remove("unknown")  # ended before it ever ran: nothing to do
    batch.add(NewRequestData("c", [4, 5], 2, SamplingParams(), [2], 0))
    assert len(batch) == 2 and len(batch.row_states) == 2
    assert batch.row_of["c"] != batch.row_of["b"]
