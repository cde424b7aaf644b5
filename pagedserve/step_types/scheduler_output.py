"""The scheduler's output: one step's work, sent to every worker (pickled) each iteration. Plain
data: the scheduler fills it, the workers read it (see step_types/__init__.py).

Keep it small: a step carries full data only for requests the workers have not seen, and diffs
for the rest, because this is sent to every worker every iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from pagedserve.lora_request import LoRARequest
from pagedserve.sampling_params import SamplerParams


@dataclass
class NewRequestData:
    """A request the workers hold no state for: first scheduled, or resumed after preemption or
    a worker restart (then `token_ids` includes the outputs so far and `num_computed_tokens` is
    whatever the prefix cache supplied)."""

    req_id: str  # the scheduler's id (a child's id when the user asked for n > 1)
    token_ids: list[int]  # prompt + output tokens known so far
    num_prompt_tokens: int  # penalties treat prompt and output tokens differently
    # Sent once; the workers keep it for the sampler. Only the sampler's fields: no stop strings.
    sampling_params: SamplerParams
    block_ids: list[int]  # the request's whole block table
    num_computed_tokens: int  # tokens whose K/V are already in the cache (prefix hits)
    lora_request: LoRARequest | None = None  # its adapter (the workers load it on first sight)


@dataclass
class CachedRequestData:
    """Diffs for requests the workers already hold, as parallel lists (cheaper to pickle)."""

    req_ids: list[str] = field(default_factory=list)  # the other lists are parallel to it
    # Tokens appended since the workers last saw the request (the token sampled last step).
    new_token_ids: list[list[int]] = field(default_factory=list)
    # Blocks appended to its table; most decode steps append none, sent as one shared empty tuple.
    new_block_ids: list[Sequence[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step's tokens

    def __len__(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step: which requests run and how many tokens each computes."""

    # Requests the workers hold no state for: sent whole.
    scheduled_new_reqs: list[NewRequestData]
    # Requests the workers already hold: only what changed since their last step.
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int  # their sum: 0 means the workers only drop state
    # Requests that ended (finished, stopped or aborted) since the last step: workers drop them.
    finished_req_ids: set[str]
    # Requests preempted this step (blocks freed, to be recomputed): workers drop their state
    # too, and the request comes back later in scheduled_new_reqs.
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: the requests of this step that sample under a grammar, and one packed
    # row each of allowed next tokens (numpy int32 [len(grammar_req_ids), ceil(vocab / 32)]; bit i
    # of word i // 32 set: token i allowed). None when no sampling request is constrained.
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None
    # LoRA: adapters that waiting requests need and the workers have not reported read; each
    # rank starts reading them off the step (workers/lora/manager.py).
    prefetch_loras: list[LoRARequest] = field(default_factory=list)
    # Adapters removed in the front end: the workers drop them once no running request uses them.
    retired_lora_ids: set[int] = field(default_factory=set)

    @classmethod
    def empty(cls, finished_req_ids: set[str] | None = None) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, finished_req_ids or set())

    @property
    def has_lora_news(self) -> bool:
        return bool(self.prefetch_loras or self.retired_lora_ids)

    @property
    def dropped_req_ids(self) -> set[str]:
        """Every request whose worker state goes: the finished and the preempted ones."""
        return self.finished_req_ids | self.preempted_req_ids
