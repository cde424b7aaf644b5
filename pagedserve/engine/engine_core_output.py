"""The scheduler's per-request news after a step, and why a request ended: engine-internal (the
output processor turns them into the user-facing outputs of request_output.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Iterator

from pagedserve.step_types.model_runner_output import TokenLogprobs


class FinishReason(enum.Enum):
    """Why a request ended. Its value is vLLM's string, which the public outputs
    (`CompletionOutput.finish_reason`) and the metrics' `finished_reason` label carry."""

    STOP = "stop"  # an EOS token, one of stop_token_ids, or a stop string
    LENGTH = "length"  # max_tokens, or max_model_len
    ABORT = "abort"  # the caller gave up on it, or the engine could not run it
    ERROR = "error"  # its own input failed once running (a grammar that did not compile): see `error`


GRAMMAR_ERROR_PREFIX = "structured outputs: "  # how an `error` from the request's grammar begins


@dataclass
class EngineCoreOutput:
    """The scheduler's news about one request after a step (engine-internal: the output
    processor turns it into a user-facing output)."""

    req_id: str  # the scheduler's id (a child's id when the user asked for n > 1)
    new_token_ids: list[int]  # tokens sampled this step
    new_logprobs: TokenLogprobs | None = None  # for new_token_ids, if the request asked
    finish_reason: FinishReason | None = None  # set once the scheduler ended it
    # The one of stop_token_ids that ended it (an EOS token leaves it None). Stop strings are
    # found later, by the output processor's detokenizer.
    stop_token_id: int | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # with FinishReason.ERROR: what failed, for the caller
    first_scheduled_time: float | None = None  # time.monotonic() when it first got compute


@dataclass
class StepOutputs:
    """One step's news. Most rows of a running batch have one new token and nothing else to say:
    not their request's first token, no logprobs, no grammar, no end. Those travel as two columns,
    which the scheduler fills and the core pickles in a fraction of the time one object a row
    takes (at 256 rows, benchmarks/engine_step_cpu.py); every other row is an EngineCoreOutput."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    token_req_ids: list[str] = field(default_factory=list)  # the plain rows' requests
    token_ids: list[int] = field(default_factory=list)  # and each one's new token

    def __len__(self) -> int:
        return len(self.outputs) + len(self.token_req_ids)

    def __iter__(self) -> Iterator[EngineCoreOutput]:
        """Every row as an EngineCoreOutput (the plain ones last): for callers that want one shape."""
        yield from self.outputs
        for req_id, token_id in zip(self.token_req_ids, self.token_ids):
            yield EngineCoreOutput(req_id, [token_id])
