"""A step too large for the channel to the workers, run as several smaller steps.

The step channel refuses messages past its size limit (workers/step_channel.py). What makes a step
large is its new requests' token lists (the workers get only a small sampling record beside them),
so a batch of long prompts can pass the limit while each prompt fits. Such a step is cut into parts
by request, each a step of its own: a request's tokens attend only to its own K/V, so running the
requests in two forward passes computes what one would. A request too large even alone cannot be
sent at all: it is returned as refused, and the engine ends it while the others go on.

Before this, an oversized step raised a ChannelError that the executor took for a dead worker:
it rebuilt the group, requeued the step, failed again, until max_worker_restarts ended the engine.
"""

from __future__ import annotations

import dataclasses
import pickle

from pagedserve.step_types.model_runner_output import ModelRunnerOutput
from pagedserve.step_types.scheduler_output import CachedRequestData, SchedulerOutput


def split_step(step: SchedulerOutput, max_bytes: int) -> tuple[list[SchedulerOutput], list[str]]:
    """Parts of `step` that each pickle to at most `max_bytes`, to run in order, and the ids of
    the requests that do not fit even alone (no part schedules them). The first part carries the
    finished and preempted ids, so workers drop those before anything else, as in the whole step.
    Halving keeps this O(size x log(requests)); it runs only for steps already found too large."""
    if len(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)) <= max_bytes:
        return [step], []
    req_ids = list(step.num_scheduled_tokens)
    if len(req_ids) <= 1:
        drops = _part(step, [], keep_drops=True)
        return ([drops] if drops.dropped_req_ids else []), req_ids
    half = len(req_ids) // 2
    first, first_refused = split_step(_part(step, req_ids[:half], keep_drops=True), max_bytes)
    rest, rest_refused = split_step(_part(step, req_ids[half:], keep_drops=False), max_bytes)
    return first + rest, first_refused + rest_refused


def merge_outputs(outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
    """One output for the whole step from its parts' (the sampling rank's) outputs."""
    merged = ModelRunnerOutput.empty()
    for output in outputs:
        merged.req_ids += output.req_ids
        merged.sampled_token_ids += output.sampled_token_ids
        if output.logprobs:
            merged.logprobs = {**(merged.logprobs or {}), **output.logprobs}
        if output.ready_lora_ids is not None:  # the last part's report is the newest
            merged.ready_lora_ids = output.ready_lora_ids
    return merged


def _part(step: SchedulerOutput, req_ids: list[str], keep_drops: bool) -> SchedulerOutput:
    """The step restricted to `req_ids` (each request with its own data: whole if new, its diff
    if the workers hold it); with or without the ids the workers drop."""
    wanted = set(req_ids)
    cached = step.scheduled_cached_reqs
    rows = [i for i, req_id in enumerate(cached.req_ids) if req_id in wanted]
    counts = {req_id: step.num_scheduled_tokens[req_id] for req_id in req_ids}
    return dataclasses.replace(
        step,
        scheduled_new_reqs=[new for new in step.scheduled_new_reqs if new.req_id in wanted],
        scheduled_cached_reqs=CachedRequestData(
            [cached.req_ids[i] for i in rows],
            [cached.new_token_ids[i] for i in rows],
            [cached.new_block_ids[i] for i in rows],
            [cached.num_computed_tokens[i] for i in rows],
        ),
        num_scheduled_tokens=counts,
        total_num_scheduled_tokens=sum(counts.values()),
        finished_req_ids=set(step.finished_req_ids) if keep_drops else set(),
        preempted_req_ids=set(step.preempted_req_ids) if keep_drops else set(),
    )
