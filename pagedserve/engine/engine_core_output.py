"""The scheduler's per-request news after a step, and why a request ended: engine-internal (the
output processor turns them into the user-facing outputs of request_output.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

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
