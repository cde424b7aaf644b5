"""Scheduler with a real KVCacheManager, driven step by step by a fake worker (no model).

Every step also runs `check_invariants` (budget, block counts, ref counts, arrival order), and the
fake worker checks the K/V each request attends over, so each test covers those as well."""

from __future__ import annotations

import math

from pagedserve.engine.engine_core_output import FinishReason
from pagedserve.engine.core.request import RequestStatus
from pagedserve.engine.core.scheduler import STEP_OVERHEAD_TOKENS, STEP_OVERHEAD_TOKENS_PER_RUNNING, STEP_TOKENS_PER_RUNNING
from tests.engine.core.scheduler_harness import (
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


def _scripted(tokens: dict[str, list[int]]) -> FakeWorker:
    """A worker that samples the listed tokens per request, then FILLER."""
    return FakeWorker(sample=lambda req_id, _: tokens[req_id].pop(0) if tokens.get(req_id) else FILLER)


def _steps_until(sched, worker, req_id: str, max_steps: int = 100):
    for _ in range(max_steps):
        out, core = step(sched, worker)
        if req_id in out.num_scheduled_tokens:
            return out, core
    raise AssertionError(f"{req_id} never scheduled")


# ---- one request's life ----------------------------------------------------------------------


def test_prefill_then_one_token_per_step_then_freed():
    sched, worker = make_scheduler(), _scripted({"a": [11, 12, 13]})
    sched.add_request(make_request("a", prompt(0, 10), max_tokens=3))
    out, core = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 10}
    (new,) = out.scheduled_new_reqs
    assert (new.token_ids, new.num_computed_tokens, new.block_ids) == (prompt(0, 10), 0, [0, 1, 2])
    assert [(c.req_id, c.new_token_ids, c.finish_reason) for c in core] == [("a", [11], None)]
    out, core = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_new_reqs == []
    out, core = step(sched, worker)
    assert [(c.new_token_ids, c.finish_reason) for c in core] == [([13], FinishReason.LENGTH)]
    assert not sched.has_unfinished_requests()
    assert sched.schedule().finished_req_ids == {"a"}  # workers drop it at the next step
    assert_no_leak(sched)


def test_cached_request_data_carries_only_the_new_token_and_new_blocks():
    sched, worker = make_scheduler(), _scripted({"a": [21, 22, 23]})
    sched.add_request(make_request("a", prompt(0, 7), max_tokens=4))
    step(sched, worker)  # 7 prompt tokens in blocks 0, 1; samples 21
    out, _ = step(sched, worker)  # computes 21 at position 7: still block 1
    cached = out.scheduled_cached_reqs
    assert (cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == (
        ["a"], [[21]], [()], [7]
    )  # no new block: the one shared empty tuple, NO_BLOCKS
    out, _ = step(sched, worker)  # computes 22 at position 8: opens block 2
    cached = out.scheduled_cached_reqs
    assert (cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == ([[22]], [[2]], [8])


# ---- the token budget and the order of service --------------------------------------------------


def test_running_requests_are_served_before_waiting_ones_within_the_budget():
    sched, worker = make_scheduler(budget=8), FakeWorker()
    sched.add_request(make_request("a", prompt(0, 6), max_tokens=8))
    sched.add_request(make_request("b", prompt(1, 6), max_tokens=8))
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 6, "b": 2}  # b gets what is left: a chunk
    sched.add_request(make_request("c", prompt(2, 20)))
    out, _ = step(sched, worker)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 4), ("c", 3)]
    assert out.total_num_scheduled_tokens == 8
    out, _ = step(sched, worker)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 1), ("c", 6)]


def test_waiting_requests_are_admitted_in_arrival_order():
    sched, worker = make_scheduler(max_num_seqs=2), FakeWorker()
    for i, req_id in enumerate("abcd"):
        sched.add_request(make_request(req_id, prompt(i, 3), max_tokens=1 if req_id == "a" else 5))
    out, _ = step(sched, worker)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a", "b"]  # max_num_seqs caps the rest
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    out, _ = step(sched, worker)  # a finished after 1 token: one seat for c
    assert [n.req_id for n in out.scheduled_new_reqs] == ["c"]
    assert [r.request_id for r in sched.running] == ["b", "c"]
    run_to_completion(sched, worker)
    assert_no_leak(sched)


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end():
    sched, worker = make_scheduler(budget=8), FakeWorker()
    sched.add_request(make_request("a", prompt(0, 20), max_tokens=2))
    chunks, computed_before, outputs = [], [], []
    for _ in range(3):
        out, core = step(sched, worker)
        chunks.append(out.num_scheduled_tokens["a"])
        computed_before += out.scheduled_cached_reqs.num_computed_tokens
        outputs.append([c.new_token_ids for c in core])
    assert chunks == [8, 8, 4]
    assert computed_before == [8, 16]  # chunks 2 and 3 start where the previous one ended
    assert outputs == [[], [], [[FILLER]]]
    assert sched.requests["a"].num_computed_tokens == 20


def test_a_least_budget_grows_with_the_running_requests():
    """min_num_batched_tokens: a step computes max(least, 16 x running) tokens, at most the budget,
    so prompts start two by two here, then in larger steps as more of them run."""
    assert STEP_TOKENS_PER_RUNNING == 16
    sched, worker = make_scheduler(budget=64, min_budget=16), FakeWorker()
    for i, name in enumerate("ab"):
        sched.add_request(make_request(name, prompt(i, 8), max_tokens=3))
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 8, "b": 8}  # nothing runs: the least budget
    for i, name in enumerate("cdef", start=2):  # the queue's share: sqrt(32 x (16 + 2 x 2)) = 25 < 32
        sched.add_request(make_request(name, prompt(i, 8), max_tokens=3))
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 8, "d": 8, "e": 8, "f": 6}  # 2 running: 32
    out, _ = step(sched, worker)
    assert out.total_num_scheduled_tokens == 7 and out.num_scheduled_tokens["f"] == 2  # five decodes, f's rest
    assert sched.step_budget() == 64  # 6 running: 96, capped at the budget
    run_to_completion(sched, worker)
    assert_no_leak(sched)


def test_a_least_budget_lets_the_next_prompt_run_whole():
    """A prompt longer than the least budget is not cut into short chunks: the step grows to hold
    it beside a token for each running request, up to the budget."""
    sched, worker = make_scheduler(budget=64, min_budget=16), FakeWorker()
    sched.add_request(make_request("a", prompt(0, 8), max_tokens=4))
    step(sched, worker)
    sched.add_request(make_request("b", prompt(1, 40)))
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 40}
    sched.add_request(make_request("c", prompt(2, 100)))  # longer than the budget: chunks of it
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 62}


def test_a_deep_queue_takes_the_square_root_of_its_tokens_times_a_steps_overhead():
    """Many waiting prompts: a step takes sqrt(waiting tokens x overhead) tokens (the queue's least
    total wait), the overhead 16 + 2 per running request, at most the budget."""
    assert (STEP_OVERHEAD_TOKENS, STEP_OVERHEAD_TOKENS_PER_RUNNING) == (16, 2)
    sched, worker = make_scheduler(budget=256, min_budget=16), FakeWorker()
    for i in range(20):
        sched.add_request(make_request(f"r{i}", prompt(i, 8), max_tokens=4))
    out, _ = step(sched, worker)
    assert out.total_num_scheduled_tokens == math.isqrt(160 * 16) == 50  # six prompts and 2 of a seventh
    assert out.num_scheduled_tokens["r6"] == 2 and len(out.num_scheduled_tokens) == 7
    # 7 running (r6's rest among them), 104 tokens waiting: sqrt(104 x 30) = 55 is below 16 x 7.
    assert sched.queue_share() == math.isqrt(104 * 30) and sched.step_budget() == 112
    for i in range(20, 80):
        sched.add_request(make_request(f"r{i}", prompt(i, 8)))
    assert sched.step_budget() == math.isqrt(584 * 30) == 132
    for i in range(80, 380):
        sched.add_request(make_request(f"r{i}", prompt(i, 8)))
    assert sched.step_budget() == 256  # the share passes the budget: capped
    run_to_completion(sched, worker)
    assert_no_leak(sched)


def test_a_least_budget_counts_the_prompts_past_their_prefix_cache_hits():
    """Prompts that share a cached prefix: the next prompt's room and the queue's tokens leave the
    hits out. Counting them (56 tokens each) would make room for all three at once, and they
    would then start, and finish, in lockstep."""
    sched, worker = make_scheduler(budget=128, min_budget=8), FakeWorker()
    shared = prompt(0, 48)
    sched.add_request(make_request("first", shared + prompt(1, 8), max_tokens=8))
    step(sched, worker)  # its 14 full blocks join the prefix cache (the last token stays to compute)
    for i, name in enumerate("abc", start=2):
        sched.add_request(make_request(name, shared + prompt(i, 8)))
    assert [sched.requests[name].expected_hit_tokens for name in "abc"] == [48, 48, 48]
    # 1 running: max(8, 16, 8 + 1, sqrt(3 x 8 x (16 + 2))) = 20, not 56 + 1.
    assert sched.queue_share() == math.isqrt(24 * 18) and sched.step_budget() == 20
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"first": 1, "a": 8, "b": 8, "c": 3}
    assert sched.requests["a"].num_computed_tokens == 56  # the 48 hits and its own 8
    run_to_completion(sched, worker)
    assert_no_leak(sched)


def test_without_a_least_budget_every_step_has_the_whole_budget():
    sched, worker = make_scheduler(budget=64), FakeWorker()
    for i, name in enumerate("abcdef"):
        sched.add_request(make_request(name, prompt(i, 8)))
    out, _ = step(sched, worker)
    assert out.total_num_scheduled_tokens == 48


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits():
    sched, worker = make_scheduler(budget=16, chunked=False), FakeWorker()
    sched.add_request(make_request("a", prompt(0, 10)))
    sched.add_request(make_request("b", prompt(1, 10)))
    sched.add_request(make_request("c", prompt(2, 2)))  # fits, but must not pass b
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 10}
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10, "c": 2}  # b whole, never a chunk


def test_max_num_seqs_caps_running_requests():
    sched, worker = make_scheduler(max_num_seqs=3), FakeWorker()
    for i in range(5):
        sched.add_request(make_request(f"r{i}", prompt(i, 2), max_tokens=10))
    for _ in range(4):
        out, _ = step(sched, worker)
        assert sorted(out.num_scheduled_tokens) == ["r0", "r1", "r2"]
    assert (sched.num_running, sched.num_waiting) == (3, 2)


# ---- prefix caching -----------------------------------------------------------------------------


def test_prefix_hit_skips_computed_tokens():
    sched, worker = make_scheduler(), FakeWorker()
    sched.add_request(make_request("a", prompt(0, 10), max_tokens=1))
    step(sched, worker)
    b = make_request("b", prompt(0, 10) + [55, 56, 57], max_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_computed_tokens == 8  # a's two full blocks: the partial third is not shared
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 5}
    core = sched.update_from_output(out, worker.execute(out))
    assert new.block_ids[:2] == [0, 1]  # a's freed blocks, revived
    assert core.outputs[0].num_cached_tokens == 8  # its first token: a whole output
    assert sched.kv_cache_manager.num_prefix_hits == 8


def test_prefix_stats_count_a_request_blocked_for_several_steps_once():
    sched, worker = make_scheduler(num_blocks=4), FakeWorker()
    sched.add_request(make_request("a", prompt(0, 8), max_tokens=1))
    step(sched, worker)  # a's two blocks stay cached after it finishes
    sched.add_request(make_request("long", prompt(1, 5), max_tokens=4))  # takes the other two
    sched.add_request(make_request("b", prompt(0, 8) + [77], max_tokens=1))  # needs one block more
    outs = run_to_completion(sched, worker)
    assert outs[4].scheduled_new_reqs[0].req_id == "b"  # looked up, and refused, in the 4 steps before
    # ...but the hit rate must count each admitted request once.
    assert (sched.kv_cache_manager.num_prefix_queries, sched.kv_cache_manager.num_prefix_hits) == (8 + 5 + 9, 8)


def test_prefix_shared_by_running_requests_is_computed_once():
    sched, worker = make_scheduler(), FakeWorker()
    shared = prompt(0, 8)
    sched.add_request(make_request("a", shared + [61], max_tokens=5))
    sched.add_request(make_request("b", shared + [62], max_tokens=5))
    out, _ = step(sched, worker)  # b's lookup runs after a's blocks were registered
    assert out.num_scheduled_tokens == {"a": 9, "b": 1}
    blocks_a, blocks_b = sched.kv_cache_manager.req_to_blocks["a"], sched.kv_cache_manager.req_to_blocks["b"]
    assert blocks_a[:2] == blocks_b[:2] and blocks_a[2] is not blocks_b[2]
    assert [b.ref_cnt for b in blocks_a[:2]] == [2, 2]
    run_to_completion(sched, worker)
    assert_no_leak(sched)


# ---- preemption ----------------------------------------------------------------------------------


def _two_requests_on_four_blocks(caching: bool = False):
    """a and b each hold 2 of 4 blocks; the step after next, a needs a third."""
    sched, worker = make_scheduler(num_blocks=4, caching=caching), FakeWorker()
    sched.add_request(make_request("a", prompt(0, 7), max_tokens=6, arrival=0.0))
    sched.add_request(make_request("b", prompt(1, 7), max_tokens=6, arrival=1.0))
    step(sched, worker)
    step(sched, worker)  # both decode position 7, the last slot of their second block
    return sched, worker


def test_preemption_frees_the_newest_request_and_requeues_it_first():
    sched, worker = _two_requests_on_four_blocks()
    sched.add_request(make_request("c", prompt(2, 1), arrival=2.0))
    out, _ = step(sched, worker)
    b = next(r for r in sched.waiting if r.request_id == "b")
    assert out.num_scheduled_tokens == {"a": 1}  # no admission after a preemption, not even c
    assert out.preempted_req_ids == {"b"} and not out.finished_req_ids  # workers drop b's state
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert sched.kv_cache_manager.get_block_ids("b") == [] and sched.kv_cache_manager.pool.num_free_blocks == 1
    assert sched.num_preemptions_total == 1


def test_preempted_request_resumes_with_prompt_and_outputs_so_far():
    sched, worker = _two_requests_on_four_blocks()
    step(sched, worker)  # b preempted
    b = sched.requests["b"]
    assert b.output_token_ids == [FILLER, FILLER]
    out, _ = _steps_until(sched, worker, "b")
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and new.token_ids == prompt(1, 7) + [FILLER, FILLER]
    assert new.num_prompt_tokens == 7 and new.num_computed_tokens == 0
    assert out.num_scheduled_tokens["b"] == 9  # recomputed, outputs included
    run_to_completion(sched, worker)
    assert b.num_output_tokens == 6 and b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_no_leak(sched)


def test_resumed_request_reuses_its_own_cached_blocks():
    sched, worker = _two_requests_on_four_blocks(caching=True)
    step(sched, worker)  # b preempted: a took b's tail block (evicted), b's first block kept its hash
    out, _ = _steps_until(sched, worker, "b")
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 4 and new.block_ids[0] == 2
    assert len(new.block_ids) == 3  # the whole table: the workers dropped the old one
    assert out.num_scheduled_tokens["b"] == 9 - 4
    assert sched.requests["b"].num_cached_tokens == 0  # reported for the first schedule only
    run_to_completion(sched, worker)
    assert_no_leak(sched)


def _one_block_requests(num_blocks: int, num_requests: int):
    """One-block requests that all need a second block at the third step."""
    sched, worker = make_scheduler(num_blocks=num_blocks, caching=False), FakeWorker()
    for i in range(num_requests):
        sched.add_request(make_request(f"r{i}", prompt(i, 3), max_tokens=4, arrival=float(i)))
    step(sched, worker)
    step(sched, worker)  # position 3 fills each first block
    return sched, worker


def test_preemption_takes_the_newest_first_and_keeps_arrival_order():
    sched, worker = _one_block_requests(num_blocks=4, num_requests=4)
    out, _ = step(sched, worker)
    # r0 preempts r3 for a block, then r1 preempts r2.
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1}
    assert [r.request_id for r in sched.waiting] == ["r2", "r3"]
    assert out.preempted_req_ids == {"r2", "r3"} and not out.finished_req_ids
    run_to_completion(sched, worker)
    assert_no_leak(sched)


def test_the_newest_request_preempts_itself_when_nothing_newer_is_left():
    sched, worker = _one_block_requests(num_blocks=3, num_requests=2)
    out, _ = step(sched, worker)
    assert out.num_scheduled_tokens == {"r0": 1}  # r0 took the last free block
    assert [r.request_id for r in sched.waiting] == ["r1"] and out.preempted_req_ids == {"r1"}
    assert sched.kv_cache_manager.pool.num_free_blocks == 1  # r1's block came back
    run_to_completion(sched, worker)
    assert_no_leak(sched)


# ---- aborts ----------------------------------------------------------------------------------------


def test_abort_waiting_and_running_requests():
    sched, worker = make_scheduler(max_num_seqs=1), FakeWorker()
    sched.add_request(make_request("run", prompt(0, 6), max_tokens=10))
    sched.add_request(make_request("wait", prompt(1, 6)))
    step(sched, worker)
    sched.finish_requests(["wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.num_waiting == 0 and "wait" not in sched.requests
    sched.finish_requests(["run"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    assert_no_leak(sched)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {} and out.finished_req_ids == {"run", "wait"}


def test_abort_while_the_step_runs_drops_its_output():
    sched, worker = make_scheduler(), FakeWorker()
    sched.add_request(make_request("a", prompt(0, 6)))
    sched.add_request(make_request("b", prompt(1, 6)))
    out = sched.schedule()
    runner_output = worker.execute(out)
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    core = sched.update_from_output(out, runner_output)
    assert [c.req_id for c in core] == ["b"]
    run_to_completion(sched, worker)
    assert_no_leak(sched)


def test_abort_of_a_preempted_request():
    sched, worker = _two_requests_on_four_blocks()
    step(sched, worker)  # b preempted, back in waiting
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in sched.waiting] == []
    run_to_completion(sched, worker)
    assert_no_leak(sched)


# ---- stop conditions -------------------------------------------------------------------------------


def _finish(req_id="a", tokens=(), prompt_len=4, max_model_len=128, **params):
    """Run one request, sampling `tokens` then FILLER, to its end."""
    sched = make_scheduler()
    worker = _scripted({req_id: list(tokens)})
    request = make_request(req_id, prompt(0, prompt_len), max_model_len=max_model_len, **params)
    sched.add_request(request)
    run_to_completion(sched, worker)
    assert_no_leak(sched)
    return request


def test_eos_stops_unless_ignore_eos():
    request = _finish(tokens=[5, EOS, 6], max_tokens=10)
    assert request.output_token_ids == [5, EOS]
    assert (request.status, request.stop_token_id) == (RequestStatus.FINISHED_STOPPED, None)
    request = _finish(tokens=[5, EOS, 6], max_tokens=4, ignore_eos=True)
    assert request.output_token_ids == [5, EOS, 6, FILLER]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_id_stops_and_is_reported():
    request = _finish(tokens=[5, 99, 6], max_tokens=10, stop_token_ids=[99])
    assert request.output_token_ids == [5, 99]
    assert (request.status, request.stop_token_id) == (RequestStatus.FINISHED_STOPPED, 99)


def test_min_tokens_suppresses_eos_and_stop_ids():
    request = _finish(tokens=[EOS, 99, EOS, 99], max_tokens=10, min_tokens=3, stop_token_ids=[99])
    assert request.output_token_ids == [EOS, 99, EOS]  # the third token may stop it
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens_wins_over_eos_on_the_same_token():
    request = _finish(tokens=[5, EOS], max_tokens=2)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_max_model_len_caps_a_request():
    request = _finish(prompt_len=10, max_model_len=12, max_tokens=100)
    assert request.num_tokens == 12 and request.num_output_tokens == 2
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    request = _finish(prompt_len=10, max_model_len=12, max_tokens=None)  # defaults to the room left
    assert request.num_output_tokens == 2


def test_tokens_after_the_first_go_as_plain_rows_until_the_end():
    """StepOutputs: a request's first token goes out whole (it carries the prefix-cache count and
    the first scheduled time), the ones after it as plain rows, its last (the end) whole again; a
    request that asks for logprobs goes out whole every step."""
    sched, worker = make_scheduler(), FakeWorker()
    sched.add_request(make_request("a", prompt(0, 5), max_tokens=4))
    sched.add_request(make_request("b", prompt(1, 5), max_tokens=4, logprobs=1))
    steps = []
    while sched.has_unfinished_requests():
        _, news = step(sched, worker)
        steps.append(([o.req_id for o in news.outputs], news.token_req_ids, news.token_ids))
    assert steps == [(["a", "b"], [], []), (["b"], ["a"], [FILLER]), (["b"], ["a"], [FILLER]), (["a", "b"], [], [])]
    assert_no_leak(sched)


def test_finished_output_reports_reason_and_frees_blocks_at_once():
    sched, worker = make_scheduler(), _scripted({"a": [99]})
    sched.add_request(make_request("a", prompt(0, 5), stop_token_ids=[99]))
    _, core = step(sched, worker)
    assert [(c.finish_reason, c.stop_token_id) for c in core] == [(FinishReason.STOP, 99)]
    assert_no_leak(sched)  # freed in update_from_output, not at the next schedule


class _Unscannable(list):
    """A stop_token_ids list that fails if scanned: the scheduler must use the Request's set."""

    def __contains__(self, item):
        raise AssertionError("the scheduler scanned stop_token_ids")

    def __iter__(self):
        raise AssertionError("the scheduler scanned stop_token_ids")


def test_stop_token_ids_are_looked_up_in_the_requests_set():
    sched, worker = make_scheduler(), _scripted({"a": [5, 6, 99]})
    request = make_request("a", prompt(0, 5), max_tokens=10, stop_token_ids=list(range(90, 346)))
    request.sampling_params.stop_token_ids = _Unscannable(request.sampling_params.stop_token_ids)
    sched.add_request(request)
    run_to_completion(sched, worker)
    assert (request.output_token_ids, request.stop_token_id) == ([5, 6, 99], 99)
    assert_no_leak(sched)


def test_new_request_data_carries_only_the_samplers_fields():
    """Stop strings stay in the engine: the step sent to every rank holds the sampler's record."""
    import pickle

    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(0, 5), stop=["x" * 256] * 16, stop_token_ids=list(range(256)), temperature=0.5))
    (new,) = sched.schedule().scheduled_new_reqs
    assert not hasattr(new.sampling_params, "stop") and new.sampling_params.stop_token_ids == ()
    assert new.sampling_params.temperature == 0.5
    assert len(pickle.dumps(new)) < 1000  # 16 x 256 characters of stop strings would be > 4 KB
