"""Admission with a KV reservation (`schedule_conservativeness`, engine/core/kv_reservation.py):
a burst larger than the cache runs without preemption, the expected output is learned from
finished requests, and a request that needs more than what is left waits its turn, alone if
need be, without letting later ones pass it.

Every step also runs `check_invariants`, which with a reservation checks that the last admission
left the running requests their expected room."""

from __future__ import annotations

import math

import pytest

from pagedserve.engine.core.kv_reservation import COLD_OUTPUT_TOKENS, MEAN_WEIGHT, KVReservation
from pagedserve.engine.core.kv_cache_manager import KVCacheManager
from pagedserve.engine.core.request import RequestStatus
from tests.engine.core.scheduler_harness import (
    BS,
    EOS,
    FILLER,
    FakeWorker,
    assert_no_leak,
    make_request,
    make_scheduler,
    prompt,
    run_to_completion,
    step,
)


def _burst(conservativeness: float):
    """8 requests of 6 prompt tokens and 10 outputs (4 blocks each at the end) on 16 blocks: all
    prompts fit at once (2 blocks each), their outputs do not."""
    sched, worker = make_scheduler(num_blocks=16, budget=64, schedule_conservativeness=conservativeness), FakeWorker()
    requests = [make_request(f"r{i}", prompt(i, 6), arrival=float(i), max_tokens=10) for i in range(8)]
    for request in requests:
        sched.add_request(request)
    outs = run_to_completion(sched, worker)
    assert_no_leak(sched)
    return sched, requests, sum(out.total_num_scheduled_tokens for out in outs)


def test_a_burst_larger_than_the_cache_runs_without_preemption():
    needed = 8 * (6 + 9)  # each prompt and every output but the last, computed once
    thrashing, _, computed = _burst(0.0)
    assert thrashing.num_preemptions_total > 0 and computed > needed  # what the reservation prevents
    reserving, requests, computed = _burst(1.0)
    assert reserving.num_preemptions_total == 0 and computed == needed
    assert all(r.output_token_ids == [FILLER] * 10 and r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in requests)


def test_a_burst_is_admitted_as_far_as_its_outputs_fit():
    sched, worker = make_scheduler(num_blocks=16, budget=64, schedule_conservativeness=1.0), FakeWorker()
    for i in range(8):
        sched.add_request(make_request(f"r{i}", prompt(i, 6), arrival=float(i), max_tokens=10))
    out, _ = step(sched, worker)
    # max_tokens (10) is below the cold guess: each reserves its 15 tokens of K/V, 4 blocks.
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1", "r2", "r3"]


def test_the_expected_output_is_learned_from_finished_requests():
    """Requests with no max_tokens (only max_model_len caps them) reserve the cold guess until
    some finish, then less and less as the mean falls to what they really take."""
    stops_after_3 = lambda req_id, token_ids: EOS if len(token_ids) >= 4 + 2 else FILLER
    sched, worker = make_scheduler(num_blocks=64, budget=64, schedule_conservativeness=1.0), FakeWorker(sample=stops_after_3)
    for i in range(40):
        sched.add_request(make_request(f"r{i}", prompt(i, 4), max_model_len=128, arrival=float(i), max_tokens=None))
    out, _ = step(sched, worker)
    # Each expects max_model_len's 127 tokens of K/V (32 blocks): two fit in 64 blocks.
    assert sorted(out.num_scheduled_tokens) == ["r0", "r1"]
    running = []
    while sched.has_unfinished_requests():
        step(sched, worker)
        running.append(len(sched.running))
    assert max(running[:3]) == 2 and max(running) >= 8  # once the mean has fallen, many at once
    assert sched.num_preemptions_total == 0 and sched.reservation.num_observed == 40
    assert sched.reservation.expected_output_tokens < 16
    assert_no_leak(sched)


def test_a_request_that_needs_more_than_is_left_waits_and_keeps_its_place():
    b_stops_after_4 = lambda req_id, token_ids: EOS if req_id == "b" and len(token_ids) >= 28 + 3 else FILLER
    sched, worker = make_scheduler(num_blocks=8, budget=64, schedule_conservativeness=1.0), FakeWorker(sample=b_stops_after_4)
    sched.add_request(make_request("a", prompt(0, 4), arrival=0.0, max_tokens=8))  # 11 tokens of K/V: 3 blocks
    # 47 tokens of K/V expected (12 blocks), more than the whole pool, and still 35 (9 blocks)
    # once a's 8 outputs have taught the scheduler; it stops after 4 outputs.
    sched.add_request(make_request("b", prompt(1, 28), arrival=1.0, max_tokens=20))
    sched.add_request(make_request("c", prompt(2, 1), arrival=2.0, max_tokens=2))  # 1 block, but behind b
    out, _ = step(sched, worker)
    assert list(out.num_scheduled_tokens) == ["a"]  # 8 free - 2 reserved for a < 12
    while "a" in sched.requests:
        out, _ = step(sched, worker)
        assert "c" not in out.num_scheduled_tokens  # never ahead of b
    out, _ = step(sched, worker)
    assert list(out.num_scheduled_tokens) == ["b"]  # alone it may always run; c waits for b's room
    while "b" in sched.requests:
        out, _ = step(sched, worker)
        assert "c" not in out.num_scheduled_tokens
    run_to_completion(sched, worker)
    assert sched.num_preemptions_total == 0 and sched.requests == {}
    assert_no_leak(sched)


def test_aborted_requests_teach_nothing_and_finished_ones_do():
    sched, worker = make_scheduler(schedule_conservativeness=1.0), FakeWorker()
    sched.add_request(make_request("a", prompt(0, 4), max_tokens=5))
    sched.add_request(make_request("b", prompt(1, 4), max_tokens=5, arrival=1.0))
    step(sched, worker)
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    run_to_completion(sched, worker)
    assert sched.reservation.num_observed == 1 and sched.reservation.mean_output_tokens == (COLD_OUTPUT_TOKENS + 5) / 2


def test_the_running_mean_and_the_conservativeness():
    reservation = KVReservation(KVCacheManager(16, BS, True), conservativeness=0.5)
    assert reservation.expected_output_tokens == COLD_OUTPUT_TOKENS // 2
    reservation.observe(16)  # the cold guess counts as one finished request
    assert reservation.mean_output_tokens == (COLD_OUTPUT_TOKENS + 16) / 2
    reservation.observe(64)
    assert reservation.mean_output_tokens == pytest.approx((COLD_OUTPUT_TOKENS + 16 + 64) / 3)
    assert reservation.expected_output_tokens == math.ceil(0.5 * (COLD_OUTPUT_TOKENS + 16 + 64) / 3)
    for _ in range(200):  # past 16 requests, each new one weighs MEAN_WEIGHT: the guess is forgotten
        reservation.observe(10)
    assert reservation.mean_output_tokens == pytest.approx(10, abs=0.01)
    before = reservation.mean_output_tokens
    reservation.observe(0)
    assert reservation.mean_output_tokens == pytest.approx(before * (1 - MEAN_WEIGHT))
    assert reservation.expected_output_tokens >= 1
    with pytest.raises(AssertionError):
        KVReservation(KVCacheManager(16, BS, True), conservativeness=0.0)


def test_a_resumed_request_reserves_at_least_its_known_tokens():
    reservation = KVReservation(KVCacheManager(16, BS, True), conservativeness=1.0)
    for _ in range(200):  # replies are expected to be 1 token long
        reservation.observe(1)
    request = make_request("a", prompt(0, 5), max_tokens=20)
    request.output_token_ids += [FILLER] * 6  # it had run past that before a preemption
    request.all_token_ids += [FILLER] * 6
    assert reservation.blocks_to_come(request, 0) == 3  # its 11 known tokens, not 5 + 1
    assert reservation.blocks_to_come(request, 1) == 2
    assert reservation.reserved_blocks([]) == 0
