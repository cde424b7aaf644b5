"""A request as the scheduler sees it.

Its truth is `prompt_token_ids + output_token_ids` and `num_computed_tokens`: everything on the
workers (KV blocks, sampler state) can be rebuilt from these three, which is how preemption and
recovery from a dead worker both work.
"""

from __future__ import annotations

import enum
import time

from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        requested = sampling_params.max_tokens
        self.max_tokens = max(max_model_len - len(prompt_token_ids), 1) if requested is None else requested
        # The most tokens this request can ever hold in the KV cache: its last token is sampled,
        # never computed, and it stops at max_model_len.
        self.max_cached_tokens = min(len(prompt_token_ids) + self.max_tokens - 1, max_model_len)
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = -1  # prompt tokens hit in the prefix cache on first schedule
        self.first_scheduled_time: float | None = None  # for the queue-time metric
        self.num_preemptions = 0
        # Tokens the workers hold for this request; the next step sends all_token_ids[this:].
        self.num_tokens_on_workers = 0
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks, filled lazily

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_id(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
