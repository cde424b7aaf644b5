"""Randomized workloads on the real Scheduler and KVCacheManager: seeded prompts (many sharing
prefixes), lengths, budgets, block sizes, pools small enough to force preemption, arrivals over
time and random aborts (between steps and while a step runs).

`check_invariants` runs after every schedule (budget, exact block counts, ref counts, sharing only
of prefix-cached blocks, arrival order) and the fake worker checks every K/V position it reads.
At the end no block is leaked, workers hold no state, and each request ended for a reason its
outputs justify."""

from __future__ import annotations

import random

from pagedserve.engine.engine_core_output import FinishReason
from pagedserve.engine.core.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from tests.engine.core.scheduler_harness import EOS, FakeWorker, assert_no_leak, check_invariants, make_scheduler

NUM_SEEDS = 150
MAX_MODEL_LEN = 48
VOCAB = range(10, 40)  # small, so sampled tokens often recreate prompt blocks


def _config(rng: random.Random) -> dict:
    block_size = rng.choice([1, 2, 4, 8])
    chunked = rng.random() < 0.75
    return dict(
        block_size=block_size,
        num_blocks=rng.randint(16, 2 * MAX_MODEL_LEN) // block_size,  # small: requests preempt each other
        budget=rng.randint(3, 40) if chunked else rng.randint(MAX_MODEL_LEN, 64),
        max_num_seqs=rng.randint(1, 8),
        chunked=chunked,
        caching=rng.random() < 0.75,
    )


def _requests(rng: random.Random, num_kv_cache_slots: int) -> list[Request]:
    prefixes = [[rng.choice(VOCAB) for _ in range(32)] for _ in range(2)]
    requests, num_requests = [], rng.randint(4, 16)
    while len(requests) < num_requests:
        length = rng.randint(1, 40)
        shared = rng.choice(prefixes)[: rng.randint(0, length)]
        prompt = shared + [rng.choice(VOCAB) for _ in range(length - len(shared))]
        max_tokens = rng.randint(1, 20)
        # The engine caps max_model_len to the cache, so no request can outgrow it; this small cache
        # sits under MAX_MODEL_LEN, so skip what could (its last token is sampled, never cached).
        if min(length + max_tokens - 1, MAX_MODEL_LEN) > num_kv_cache_slots:
            continue
        params = dict(
            max_tokens=max_tokens,
            min_tokens=rng.randint(0, max_tokens) if rng.random() < 0.3 else 0,
            stop_token_ids=[rng.choice(VOCAB)] if rng.random() < 0.3 else None,
            ignore_eos=rng.random() < 0.2,
        )
        request_id = f"r{len(requests)}"
        arrival = float(len(requests))
        requests.append(Request(request_id, prompt, SamplingParams(**params), frozenset({EOS}), MAX_MODEL_LEN, arrival))
    return requests


def _maybe_abort(rng: random.Random, sched, aborted: set[str]) -> None:
    if sched.requests and rng.random() < 0.04:
        req_id = rng.choice(sorted(sched.requests))
        sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
        aborted.add(req_id)


class _Client:
    """What the engine above the scheduler sees: streamed tokens, finish reasons, aborts."""

    def __init__(self, requests: list[Request]):
        self.streamed: dict[str, list[int]] = {r.request_id: [] for r in requests}
        self.reasons: dict[str, FinishReason] = {}
        self.aborted: set[str] = set()

    def receive(self, core_outputs) -> None:
        for core in core_outputs:
            self.streamed[core.req_id] += core.new_token_ids
            if core.finish_reason:
                self.reasons[core.req_id] = core.finish_reason


def _drive(rng: random.Random, sched, worker: FakeWorker, pending: list[Request], client: _Client) -> int:
    """Steps until every request has arrived and ended; returns the number of steps."""
    for step_no in range(5000):
        if not pending and not sched.has_unfinished_requests():
            return step_no
        while pending and (rng.random() < 0.6 or not sched.has_unfinished_requests()):
            sched.add_request(pending.pop(0))
        num_preemptions = sched.num_preemptions_total
        out = sched.schedule()
        check_invariants(sched, out, num_preemptions)
        runner_output = worker.execute(out)
        _maybe_abort(rng, sched, client.aborted)  # while the step runs
        client.receive(sched.update_from_output(out, runner_output))
        _maybe_abort(rng, sched, client.aborted)
    raise AssertionError("no progress")


def _run(seed: int) -> dict:
    rng = random.Random(seed)
    config = _config(rng)
    # Every third workload reserves KV for expected outputs at admission (kv_reservation.py),
    # chosen by the seed and not drawn from rng, so each seed keeps the workload it always had.
    sched = make_scheduler(**config, schedule_conservativeness=(0.0, 0.0, 1.0)[seed % 3])
    worker = FakeWorker(config["block_size"], sample=lambda *_: EOS if rng.random() < 0.08 else rng.choice(VOCAB))
    requests = _requests(rng, config["num_blocks"] * config["block_size"])
    client = _Client(requests)
    num_steps = _drive(rng, sched, worker, list(requests), client)
    worker.execute(sched.schedule())  # delivers the last finished ids
    assert not worker.states, f"workers kept {sorted(worker.states)}"
    assert_no_leak(sched)
    for request in requests:
        _check_outcome(request, client)
    return dict(
        preemptions=sched.num_preemptions_total,
        hits=sched.kv_cache_manager.num_prefix_hits,
        aborts=len(client.aborted),
        steps=num_steps,
    )


def _check_outcome(request: Request, client: _Client) -> None:
    """Every sampled token reached the caller exactly once, and the request ended when it should."""
    reason = client.reasons.get(request.request_id)
    assert client.streamed[request.request_id] == request.output_token_ids, request
    assert request.is_finished, request
    if request.request_id in client.aborted:
        assert request.status == RequestStatus.FINISHED_ABORTED and reason is None
        return
    params, outputs = request.sampling_params, request.output_token_ids
    stop_ids = set(request.eos_token_ids) | set(params.stop_token_ids)
    # No token that could have stopped the request was let through.
    assert not any(t in stop_ids for t in outputs[max(params.min_tokens - 1, 0) : -1]), request
    assert request.num_output_tokens <= request.max_tokens and request.num_tokens <= MAX_MODEL_LEN
    if reason == FinishReason.LENGTH:
        assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert request.num_output_tokens == request.max_tokens or request.num_tokens == MAX_MODEL_LEN
    else:
        assert reason == FinishReason.STOP and request.status == RequestStatus.FINISHED_STOPPED, (request, reason)
        assert outputs[-1] in stop_ids
        assert request.num_output_tokens >= params.min_tokens
        expected_stop_token_id = None if outputs[-1] in request.eos_token_ids else outputs[-1]
        assert request.stop_token_id == expected_stop_token_id


def test_random_workloads_keep_every_invariant():
    totals = {"preemptions": 0, "hits": 0, "aborts": 0, "steps": 0}
    for seed in range(NUM_SEEDS):
        try:
            stats = _run(seed)
        except AssertionError as error:
            raise AssertionError(f"seed {seed}: {error}") from error
        for key, value in stats.items():
            totals[key] += value
    # The workloads must actually reach the paths they are meant to stress.
    assert totals["preemptions"] > 100, totals
    assert totals["hits"] > 1000, totals
    assert totals["aborts"] > 50, totals
