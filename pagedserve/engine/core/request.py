"""A request as the scheduler sees it.

Its truth is `prompt_token_ids + output_token_ids` and `num_computed_tokens`: everything on the
workers (KV blocks, sampler state) can be rebuilt from these three, which is how preemption and
recovery from a dead worker both work.
"""

from __future__ import annotations

import enum
import time

from pagedserve.engine.engine_core_output import FinishReason
from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import SamplingParams


def resolve_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """The request's `max_tokens`, or when it names none, whatever room `max_model_len` leaves
    (at least one token)."""
    if params.max_tokens is not None:
        return params.max_tokens
    return max(max_model_len - num_prompt_tokens, 1)


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # its structured-output grammar is still compiling
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
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
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
        resumed_output_token_ids: list[int] = (),
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ):
        """`resumed_output_token_ids`: outputs another replica generated before it handed the
        request over; they count as outputs (max_tokens, penalties, seeds), and the prefill
        recomputes their K/V along with the prompt's."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset() if sampling_params.ignore_eos else eos_token_ids
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = list(resumed_output_token_ids)
        self.all_token_ids: list[int] = [*prompt_token_ids, *resumed_output_token_ids]
        self.num_computed_tokens = 0
        self.max_tokens = resolve_max_tokens(sampling_params, len(prompt_token_ids), max_model_len)
        # Both length limits as one token count (outputs include resumed ones): the scheduler's
        # per-step check is then one comparison, and one set lookup for the tokens that may stop it.
        self.length_cap = min(max_model_len, len(prompt_token_ids) + self.max_tokens)
        self.stop_ids = self.eos_token_ids | frozenset(sampling_params.stop_token_ids)
        self.stop_token_id: int | None = None  # the one of stop_token_ids that ended it
        # Prompt tokens hit in the prefix cache when first scheduled; None until then (a request
        # resumed after preemption keeps its first count).
        self.num_cached_tokens: int | None = None
        self.first_scheduled_time: float | None = None  # for the queue-time metric
        # Prefix-cache hits the scheduler last found while it waited: the step budget's estimate of
        # the prompt tokens it will not compute (the scheduler refreshes the next one's every step).
        self.expected_hit_tokens = 0
        self.num_preemptions = 0
        # Its first output has gone out, and it has no grammar and asks no logprobs: a step's news
        # of it is then one token, a plain row (StepOutputs), unless the token ends it.
        self.plain_news = False
        # Tokens the workers hold for this request; the next step sends all_token_ids[this:].
        self.num_tokens_on_workers = 0
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks, filled lazily
        # The tenant's salt, mixed into the first block's hash: prefix-cache hits stay within a
        # tenant (None: shared with every unsalted request).
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # its adapter; 0 below is the base model
        self.lora_int_id = lora_request.lora_int_id if lora_request is not None else 0
        # Its structured-output grammar and matcher (engine/structured_outputs), or None.
        self.grammar = None
        # Output tokens before the grammar applies (a reasoning model's thinking); None while
        # the reasoning goes on. 0 without a reasoning parser.
        self.grammar_start: int | None = 0

    @property
    def grammar_token_ids(self) -> list[int]:
        """The output tokens its grammar has seen (none while the reasoning goes on)."""
        return [] if self.grammar_start is None else self.output_token_ids[self.grammar_start :]

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
