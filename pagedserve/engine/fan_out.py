"""The n > 1 fan-out, in one place: a request for n completions runs as n independent scheduler
requests ("children"). Every side that needs the children derives them from here: the front end's
output processor (which merges their outputs back), the engine core (which schedules them and
aborts them by the user's id) and the cluster's handover (which moves each unfinished choice as a
one-sample request of its own, so choice i must get exactly the params child i had).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Child:
    index: int  # the choice's index in the user's output (CompletionOutput.index)
    request_id: str  # the scheduler's id: the user's own when n == 1
    params: SamplingParams  # n == 1; a seeded parent's child i has the seed `seed + i`


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params choice `index` of a request runs with (the request's own when n == 1)."""
    return params if params.n == 1 else params.for_child(index)


def child_ids(request_id: str, n: int) -> list[str]:
    return [request_id] if n == 1 else [child_request_id(request_id, i) for i in range(n)]


def fan_out(request_id: str, params: SamplingParams) -> list[Child]:
    """The request's n children, in index order."""
    ids = child_ids(request_id, params.n)
    return [Child(index, ids[index], child_params(params, index)) for index in range(params.n)]
