"""split_step: a step too large for the worker channel, cut by request into steps that fit."""

from __future__ import annotations

import pickle

from pagedserve.step_types.model_runner_output import ModelRunnerOutput, TokenLogprobs
from pagedserve.step_types.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedserve.engine.core.step_split import merge_outputs, split_step
from pagedserve.sampling_params import SamplingParams


def size(step: SchedulerOutput) -> int:
    return len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))


def new(req_id: str, num_tokens: int) -> NewRequestData:
    return NewRequestData(req_id, [300] * num_tokens, num_tokens, SamplingParams().sampler_params(), [1, 2], 0)


def make_step(new_sizes: dict[str, int], cached_ids: list[str]) -> SchedulerOutput:
    cached = CachedRequestData()
    for req_id in cached_ids:
        cached.req_ids.append(req_id)
        cached.new_token_ids.append([7])
        cached.new_block_ids.append([])
        cached.num_computed_tokens.append(20)
    counts = {**{r: 1 for r in cached_ids}, **new_sizes}
    return SchedulerOutput([new(r, n) for r, n in new_sizes.items()], cached, counts, sum(counts.values()), {"gone"}, {"preempted"})


def test_a_step_that_fits_is_left_whole():
    step = make_step({"a": 10}, ["c"])
    assert split_step(step, size(step)) == ([step], [])


def test_parts_fit_cover_every_request_once_and_drop_first():
    step = make_step({"a": 100, "b": 100, "c": 100, "huge": 1000}, ["d", "e"])
    limit = size(make_step({"a": 100}, [])) + 50
    parts, refused = split_step(step, limit)
    assert refused == ["huge"]
    assert all(size(part) <= limit for part in parts) and len(parts) >= 3
    scheduled = [req_id for part in parts for req_id in part.num_scheduled_tokens]
    assert sorted(scheduled) == ["a", "b", "c", "d", "e"]
    assert parts[0].finished_req_ids == {"gone"} and parts[0].preempted_req_ids == {"preempted"}
    assert all(not part.dropped_req_ids for part in parts[1:])
    for part in parts:
        assert part.total_num_scheduled_tokens == sum(part.num_scheduled_tokens.values())
        assert {n.req_id for n in part.scheduled_new_reqs} | set(part.scheduled_cached_reqs.req_ids) == set(part.num_scheduled_tokens)
        assert part.scheduled_cached_reqs.num_computed_tokens == [20] * len(part.scheduled_cached_reqs)


def test_a_lone_request_too_large_still_sends_the_drops():
    parts, refused = split_step(make_step({"huge": 1000}, []), 400)
    assert refused == ["huge"]
    assert [(p.num_scheduled_tokens, p.finished_req_ids) for p in parts] == [({}, {"gone"})]


def test_merge_outputs():
    lp = TokenLogprobs([5], [-0.1], 1)
    merged = merge_outputs([ModelRunnerOutput(["a"], [5], {"a": lp}), ModelRunnerOutput.empty(), ModelRunnerOutput(["b"], [6])])
    assert (merged.req_ids, merged.sampled_token_ids, merged.logprobs) == (["a", "b"], [5, 6], {"a": lp})
    assert merge_outputs([ModelRunnerOutput(["b"], [6])]).logprobs is None
